"""Which megatron full fine-tuning checkpoint loads under which layout (pure: no torch, so CI checks it).

`miles_state.json` records the format, backend, train mode and the TP, pipeline, context and DP sizes. The
weights files are per TP rank (x pipeline stage) and written once for all data and context parallel ranks,
so they load at any data and context size. The distributed optimizer's shards cut the fp32 main weights and
Adam's moments over data x context ranks, so with the optimizer every size must match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATE_FORMAT = 1
STATE_LAYOUT_KEYS = ("format", "backend", "tensor", "pipeline", "context", "data")
WEIGHTS_LAYOUT_KEYS = STATE_LAYOUT_KEYS[:4]  # what the weights files depend on (not context or data)
# what a checkpoint written before a layout key existed ran with
STATE_LAYOUT_DEFAULTS = {"pipeline": 1, "context": 1}


def running_layout(tensor: int, pipeline: int, context: int, data: int) -> dict[str, Any]:
    """This trainer's layout, keyed as miles_state.json keys it."""
    return dict(
        zip(STATE_LAYOUT_KEYS, (STATE_FORMAT, "megatron", tensor, pipeline, context, data), strict=True)
    )


def state_layout_problem(meta: Mapping[str, Any], mine: Mapping[str, Any], *, optimizer: bool) -> str | None:
    """Why a checkpoint (its miles_state.json) cannot load here, naming the layout saved, the one running and
    the fix; None when it loads. `optimizer`: its optimizer shards are to be loaded too."""
    keys = STATE_LAYOUT_KEYS if optimizer else WEIGHTS_LAYOUT_KEYS
    theirs = {k: meta.get(k, STATE_LAYOUT_DEFAULTS.get(k)) for k in STATE_LAYOUT_KEYS}
    if all(theirs[k] == mine[k] for k in keys):
        return None
    kind = (theirs["format"], theirs["backend"], meta.get("train_mode"))
    if kind != (STATE_FORMAT, "megatron", "full"):
        return (
            f"is a {meta.get('train_mode')!r} checkpoint of backend {theirs['backend']!r} (format "
            f"{theirs['format']}); this trainer is megatron full fine-tuning (format {STATE_FORMAT}): "
            "load it in a trainer of the kind that wrote it"
        )
    saved = ", ".join(f"{k} {theirs[k]}" for k in STATE_LAYOUT_KEYS)
    running = ", ".join(f"{k} {mine[k]}" for k in STATE_LAYOUT_KEYS)
    if optimizer and all(theirs[k] == mine[k] for k in WEIGHTS_LAYOUT_KEYS):
        fix = (
            "its optimizer shards (Adam's moments cut over data x context ranks) load only under the layout "
            f"that wrote them: run model.parallel context={theirs['context']} data={theirs['data']}, or load "
            "the weights without the optimizer (load_state, a fresh Adam)"
        )
    else:
        fix = (
            "megatron weights files are per tensor-parallel rank and pipeline stage: run model.parallel "
            f"tensor={theirs['tensor']} pipeline={theirs['pipeline']} (without the optimizer, any context "
            "and data)"
        )
    return f"was saved at ({saved}); this trainer runs ({running}): {fix}"
