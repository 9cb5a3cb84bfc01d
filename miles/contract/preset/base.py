"""What every preset section shares: strict models (no YAML 1.1 coercion, unknown keys refused), the
preset error, environment maps and names."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _env_values_as_text(value: Any) -> Any:
    """`OMP_NUM_THREADS: 4` means the text "4": numbers and booleans become the text YAML wrote."""
    if not isinstance(value, dict):
        return value
    return {key: _env_text(key, item) for key, item in value.items()}


def _env_text(key: Any, item: Any) -> str:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return str(item)
    if item is None:
        return ""
    if not isinstance(item, str):
        raise ValueError(
            f"{key}: an environment value is text, a number or a boolean, not {type(item).__name__}"
        )
    return item


EnvMap = Annotated[dict[str, str], BeforeValidator(_env_values_as_text)]
Port = Annotated[int, Field(ge=1, le=65535)]


class PresetError(ValueError):
    """A preset (or an override of it) is invalid; the message names the offending key."""


def check_env_names(env: EnvMap) -> EnvMap:
    for key in env:
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
    return env


class StrictModel(BaseModel):
    # strict: no YAML 1.1 style coercion (a boolean or the text "8" is not an integer)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
