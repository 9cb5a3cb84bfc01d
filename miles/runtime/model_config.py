"""What a model directory's config.json says about the model, read without loading it."""

from __future__ import annotations

import json
from pathlib import Path


def model_arch(model_dir: Path | str) -> str | None:
    """The architecture family the config names (`model_type`, e.g. "qwen3", "llama"); None when the
    directory has no readable config (a card can still serve, get_info then reports no arch)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    arch = config.get("model_type") if isinstance(config, dict) else None
    return arch if isinstance(arch, str) and arch else None
