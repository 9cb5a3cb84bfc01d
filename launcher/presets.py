"""Presets as the launcher loads them: a shipped name or a path, layered with the user's defaults file,
GATEWAY_DEAD_PROBES from the environment and `--set` overrides, then validated and resolved.

What a preset *is* (its schema, checks and resolution) is the contract both halves share:
`miles.contract.preset`. The job reads the resolved file this writes with `read_resolved`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from launcher.layers import Layered
from launcher.shipped import shipped_dir
from miles.contract import strict_yaml
from miles.contract.preset import DEAD_PROBES_ENV, Preset, PresetError, parse_dead_probes
from miles.contract.preset.base import SAFE_NAME
from miles.contract.preset.files import read_preset_file, validate_preset, yaml_error_text

PRESETS_DIR = shipped_dir("presets")


def list_presets() -> list[str]:
    """Names of the shipped presets (`presets/<name>.yaml`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """The YAML file of a shipped preset name, or the given path."""
    candidate = Path(name_or_path)
    looks_like_path = candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path
    if looks_like_path or candidate.is_file():
        if not candidate.is_file():
            raise PresetError(f"preset file {name_or_path!r} does not exist")
        return candidate.resolve()
    shipped = PRESETS_DIR / f"{name_or_path}.yaml"
    if not SAFE_NAME.fullmatch(name_or_path) or not shipped.is_file():
        raise PresetError(
            f"unknown preset {name_or_path!r}: use one of {', '.join(list_presets())} "
            "or a path to a YAML file"
        )
    return shipped


SOURCE_PRESET = "preset"
SOURCE_ENV = "environment"
SOURCE_SET = "--set"


def load_preset(
    name_or_path: str,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = "defaults file",
) -> Preset:
    """Load a preset by shipped name or path, then apply the user's defaults, GATEWAY_DEAD_PROBES from
    `env` and the `--set` overrides, in that order (each wins over the ones before it).

    `defaults` is the preset part of the user's defaults file (the launcher reads it; the job does not).
    """
    return load_layers(name_or_path, overrides, env, defaults, defaults_source)[0]


def load_layers(
    name_or_path: str,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = "defaults file",
) -> tuple[Preset, Layered]:
    """`load_preset`, also returning the layers: which of them set each value."""
    path = preset_path(name_or_path)
    layered = Layered()
    layered.put_all(read_preset_file(path), SOURCE_PRESET)
    if defaults:
        layered.put_all(defaults, defaults_source)
    parsed = [parse_override(override) for override in overrides]
    env = os.environ if env is None else env
    overridden = any(parts[:2] in (["watchdog"], ["watchdog", "dead_probes"]) for parts, _ in parsed)
    if DEAD_PROBES_ENV in env and not overridden:  # --set wins, even over a bad value in the environment
        layered.put(("watchdog", "dead_probes"), parse_dead_probes(env[DEAD_PROBES_ENV]), SOURCE_ENV)
    for parts, value in parsed:
        layered.put(tuple(parts), value, SOURCE_SET)
    return validate_preset(layered.data, source=str(path)), layered


def parse_override(override: str) -> tuple[list[str], Any]:
    """(key path, value) of one `a.b=c` override; the key must exist, the value is strict YAML."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise PresetError(
            f"--set {override!r}: expected KEY=VALUE with a dotted key, e.g. watchdog.dead_probes=2"
        )
    _check_override_path(parts, override)
    try:
        value = strict_yaml.load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise PresetError(f"--set {override!r}: value is not valid YAML: {yaml_error_text(exc)}") from None
    return parts, value


def _check_override_path(parts: list[str], override: str) -> None:
    model: type[BaseModel] | None = Preset
    for depth, part in enumerate(parts):
        if model is None:  # inside a free-form mapping (env, server_args): any key goes
            return
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:depth]) or "the top level"
            raise PresetError(
                f"--set {override!r}: unknown key {'.'.join(parts[: depth + 1])!r}; "
                f"keys under {where}: {', '.join(fields)}"
            )
        model, is_mapping = nested_model(fields[part].annotation)
        if model is None and not is_mapping and depth < len(parts) - 1:
            raise PresetError(f"--set {override!r}: {'.'.join(parts[: depth + 1])!r} has no sub-keys")


def nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(model class, is a free mapping) for a field annotation, looking through Optional."""
    candidates = (
        get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    )
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, False
        if candidate is dict or get_origin(candidate) is dict:
            return None, True
    return None, False
