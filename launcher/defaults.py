"""The user's defaults file: values typed on every submit (PBS project, Slurm account ...) kept in one place.

`$MILES_DEFAULTS`, else `$XDG_CONFIG_HOME/miles/defaults.yaml` (`~/.config/miles/defaults.yaml`):

    scheduler:            # any key of a preset's `scheduler:` section
      pbs: {project: gaa50000, queue: rt_HF}
      slurm: {account: myacct, partition: gpu}
    runs_dirs:            # where `launcher runs --all` looks, besides the current runs directory
      - /groups/gaa50000/me/runs

The launcher applies it over the preset and under `--set`; the job never reads it (the resolved preset
in the run directory already holds its values).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from launcher.layers import Layered
from launcher.presets import load_layers
from miles.contract import strict_yaml
from miles.contract.preset import Preset, PresetError
from miles.contract.preset.files import format_errors, yaml_error_text
from miles.contract.preset.scheduler import SchedulerOptions

DEFAULTS_ENV = "MILES_DEFAULTS"
TOP_LEVEL_KEYS = ("scheduler", "runs_dirs")


class DefaultsError(PresetError):
    """The defaults file is unreadable or holds something a preset would refuse."""


@dataclass(frozen=True)
class UserDefaults:
    path: Path | None = None  # None: no defaults file
    preset: dict[str, Any] = field(default_factory=dict)  # applied over every preset
    runs_dirs: tuple[Path, ...] = ()

    @property
    def label(self) -> str:
        return f"defaults file {self.path}"


def defaults_path(env: Mapping[str, str]) -> Path | None:
    """The defaults file in use: $MILES_DEFAULTS (which must exist), else the user's config file if any."""
    named = env.get(DEFAULTS_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise DefaultsError(f"{DEFAULTS_ENV}={named}: no such file (unset it, or create the file)")
        return path
    config_home = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    path = Path(config_home) / "miles" / "defaults.yaml"
    return path if path.is_file() else None


def load_defaults(env: Mapping[str, str] | None = None) -> UserDefaults:
    env = os.environ if env is None else env
    path = defaults_path(env)
    if path is None:
        return UserDefaults()
    try:
        data = strict_yaml.load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DefaultsError(f"{path}: not UTF-8 text: save the file as UTF-8") from None
    except OSError as exc:
        raise DefaultsError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise DefaultsError(f"{path}: not valid YAML: {yaml_error_text(exc)}") from None
    return parse_defaults(data or {}, path)


def parse_defaults(data: Any, path: Path) -> UserDefaults:
    """Check the file's shape and its scheduler values (as a preset would) before any preset is loaded."""
    if not isinstance(data, dict):
        raise DefaultsError(f"{path}: a defaults file is a YAML mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise DefaultsError(
            f"{path}: unknown key(s) {', '.join(map(str, unknown))}: "
            f"a defaults file holds {', '.join(TOP_LEVEL_KEYS)}"
        )
    scheduler = data.get("scheduler") or {}
    try:
        SchedulerOptions.model_validate(scheduler)
    except ValidationError as exc:
        raise DefaultsError(
            f"{path}: invalid defaults:\n" + format_errors(exc, prefix="scheduler.")
        ) from None
    runs_dirs = data.get("runs_dirs") or []
    if not isinstance(runs_dirs, list) or not all(isinstance(d, str) and d for d in runs_dirs):
        raise DefaultsError(f"{path}: runs_dirs is a list of directory paths")
    preset = without_empty_sections({"scheduler": scheduler})
    return UserDefaults(path, preset, tuple(Path(d).expanduser() for d in runs_dirs))


def without_empty_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Drop empty mappings: `pbs: {}` in a defaults file sets nothing (it must not blank the preset's)."""
    kept = {}
    for key, value in data.items():
        if isinstance(value, dict):
            value = without_empty_sections(value)
            if not value:
                continue
        kept[key] = value
    return kept


def load_user_layers(
    name_or_path: str, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> tuple[Preset, Layered]:
    """A preset as the launcher's commands load it: the file, the user's defaults, the environment, --set."""
    env = os.environ if env is None else env
    user = load_defaults(env)
    return load_layers(name_or_path, overrides, env, user.preset, user.label)


def load_user_preset(
    name_or_path: str, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Preset:
    """`load_user_layers` without the layers: what `submit`, `render` and `doctor` run."""
    return load_user_layers(name_or_path, overrides, env)[0]
