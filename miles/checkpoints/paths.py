"""Pure parsing and validation of checkpoint addresses; nothing here touches the disk.

A Tinker path is `tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}`: exactly three
segments. The REST API names the same checkpoint `{kind}/{name}` under a training run (= model id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from miles.errors import NotFoundError, UserError

CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
CHECKPOINT_KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights", "external_weights")
TINKER_SCHEME = "tinker://"

# Model ids are `{session}:train:{n}`; they start with a letter or digit, so no model directory can
# collide with the manager's own `.staging`/`.trash` folders or be `.`/`..`.
MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


class CheckpointNotFound(NotFoundError):
    """No such checkpoint for this caller (also: malformed, traversal, another tenant's). Maps to 404."""


class InvalidCheckpointName(UserError):
    """A save asked for a model id or name that cannot be a checkpoint directory."""


class CheckpointExists(UserError):
    """A save would replace a committed checkpoint without being allowed to."""


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: CheckpointKind
    name: str

    @property
    def uri(self) -> str:
        return f"{TINKER_SCHEME}{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def index_key(self) -> str:
        return f"{self.model_id}/{self.kind}/{self.name}"


def is_valid_model_id(model_id: object) -> bool:
    return isinstance(model_id, str) and MODEL_ID_RE.fullmatch(model_id) is not None


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None and name not in (".", "..")


def _checked(model_id: object, kind: object, name: object) -> TinkerPath | None:
    if is_valid_model_id(model_id) and kind in CHECKPOINT_KINDS and is_valid_name(name):
        return TinkerPath(model_id, kind, name)  # type: ignore[arg-type]
    return None


def parse_tinker_path(path: object) -> TinkerPath:
    """`tinker://{model_id}/{kind}/{name}` -> TinkerPath; anything else is CheckpointNotFound."""
    if isinstance(path, str) and path.startswith(TINKER_SCHEME):
        parts = path[len(TINKER_SCHEME) :].split("/")
        parsed = _checked(*parts) if len(parts) == 3 else None
        if parsed is not None:
            return parsed
    raise CheckpointNotFound(f"not a checkpoint path: {path!r}")


def parse_checkpoint_id(model_id: object, checkpoint_id: object) -> TinkerPath:
    """The REST form (`training_runs/{model_id}/checkpoints/{kind}/{name}`) -> TinkerPath, else not found."""
    parts = checkpoint_id.split("/") if isinstance(checkpoint_id, str) else []
    parsed = _checked(model_id, *parts) if len(parts) == 2 else None
    if parsed is None:
        raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r} in training run {model_id!r}")
    return parsed


def checked_new_path(model_id: str, kind: str, name: str) -> TinkerPath:
    """Validate the address of a checkpoint about to be written, saying what to fix."""
    if not is_valid_model_id(model_id):
        raise InvalidCheckpointName(f"model id {model_id!r} must match {MODEL_ID_RE.pattern}")
    if kind not in CHECKPOINT_KINDS:
        raise InvalidCheckpointName(f"checkpoint kind {kind!r} must be one of {', '.join(CHECKPOINT_KINDS)}")
    if not is_valid_name(name):
        raise InvalidCheckpointName(
            f"checkpoint name {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-' "
            "(not '.' or '..')"
        )
    return TinkerPath(model_id, kind, name)  # type: ignore[arg-type]
