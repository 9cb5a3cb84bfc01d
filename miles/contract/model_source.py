"""Where a preset's model lives: a local directory, or a hub name resolved offline from the HF cache.

Compute nodes usually have no internet, so nothing is ever downloaded here: the launcher checks the name
at submit (on the submitting machine) and the driver resolves it again at bring-up (on the head node),
both through huggingface_hub's own offline lookup. The cache must sit where every node sees it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Checked in this order; the first one set wins (as huggingface_hub reads them at import).
HUB_CACHE_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
HF_HOME_ENV = "HF_HOME"


class ModelNotFound(ValueError):
    """model.path names nothing usable here; the message says how to fix it (the caller's to fix)."""


@dataclass(frozen=True)
class ResolvedModel:
    directory: Path  # the Hugging Face model directory every cell loads
    hub_name: str | None  # "Org/Name" when model.path was a hub name, else None


def looks_like_hub_name(path: str) -> bool:
    """`Org/Name` (one slash, hub characters), not a path such as `/models/x`, `./x` or `~/x`."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """The hub cache `env` points at; huggingface_hub's default when it sets none."""
    for name in HUB_CACHE_ENV:
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get(HF_HOME_ENV):
        return Path(env[HF_HOME_ENV]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model_path(path: str, env: Mapping[str, str] | None = None) -> ResolvedModel:
    """A local directory as is; a hub name as its cached snapshot directory. Raises ModelNotFound."""
    local = Path(path).expanduser()
    if local.is_dir():
        return ResolvedModel(local.resolve(), None)
    if not looks_like_hub_name(path):
        raise ModelNotFound(
            f"model.path {path!r} is not a directory here, nor a hub name like 'Org/Name': "
            "set model.path to a Hugging Face model directory"
        )
    return ResolvedModel(_cached_snapshot(path, hub_cache_dir(os.environ if env is None else env)), path)


def _cached_snapshot(name: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    fix = (
        f"download it on a machine with internet into the cache every node reads "
        f"(`HF_HUB_CACHE={cache} huggingface-cli download {name}`), or set model.path to a model directory"
    )
    try:
        snapshot = Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ModelNotFound(
            f"model.path {name!r} is a hub name that is not in the Hugging Face cache at {cache} "
            f"(HF_HUB_CACHE / HF_HOME): {fix}"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"model.path {name!r}: the cached snapshot {snapshot} has no config.json: {fix}")
    return snapshot.resolve()
