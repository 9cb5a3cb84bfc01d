"""Reading a preset file and validating a preset mapping, with errors that name every bad key: the
launcher reads presets with it at submit, the job reads the resolved preset it wrote."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from miles.contract import strict_yaml
from miles.contract.preset.base import PresetError
from miles.contract.preset.preset import Preset, resolve


def read_preset_file(path: Path) -> dict[str, Any]:
    """The raw mapping of a preset file, read with the strict YAML rules; every failure is a PresetError."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PresetError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            "save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise PresetError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = strict_yaml.load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{path}: not valid YAML: {yaml_error_text(exc)}") from None
    if not isinstance(data, dict):
        raise PresetError(f"{path}: a preset is a YAML mapping, got {type(data).__name__}")
    return data


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}".split())


def validate_preset(data: Mapping[str, Any], source: str = "preset") -> Preset:
    """Validate a preset mapping; errors name every bad key as a dotted path."""
    try:
        return resolve(Preset.model_validate(data))
    except ValidationError as exc:
        raise PresetError(f"{source}: invalid preset:\n" + format_errors(exc)) from None
    except PresetError as exc:
        raise PresetError(f"{source}: {exc}") from None


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """One indented line per problem, each naming its key path (under `prefix`)."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"])
        path = prefix + path if path else path
        if err["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key (not part of a preset; check the spelling)")
        elif err["type"] == "missing":
            lines.append(f"  {path}: required key is missing")
        elif err["type"] in _STRICT_TYPE_HINTS:
            lines.append(f"  {path}: {_as_written(err['input'])} {_STRICT_TYPE_HINTS[err['type']]}")
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"  {path}: {message}" if path else f"  {message}")  # cross-field: names its keys
    return "\n".join(lines)


def _as_written(value: Any) -> str:
    """A refused value as the user wrote it in YAML (true, not Python's True)."""
    return (
        "true" if value is True else "false" if value is False else "null" if value is None else repr(value)
    )


# Strict types refuse what YAML 1.1 would have coerced; say what to write instead
_STRICT_TYPE_HINTS = {
    "int_type": "is not an integer: write plain decimal digits, e.g. 4 (yes/true/010 are not numbers)",
    "bool_type": "is not a boolean: write true or false (yes/no/on/off are not booleans)",
    "string_type": 'is not text: quote it, e.g. "2024"',
    "float_type": "is not a number: write digits, e.g. 30 or 0.5",
}


def read_resolved(path: Path) -> Preset:
    """The resolved preset the launcher wrote into the run directory (RUN_DIR/preset.yaml), as the job
    reads it: no defaults file, no environment, no overrides (all applied at submit)."""
    return validate_preset(read_preset_file(path), source=str(path))
