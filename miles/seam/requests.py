"""The runtime's training calls as values, defined once.

The gateway builds them, every Runtime passes them on unchanged (a router to the handle's instance, the
metered wrapper), and the trainer's commands (miles.train.commands.ForwardBackward, OptimStep) are these
requests with a `run` on a backend, so the fields of a training call are spelled here only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.types import AdamParams, Datum


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    data: Sequence[Datum]
    loss_fn: str  # one of miles.contract.losses.LOSS_NAMES (the gateway refuses others)
    loss_config: Mapping[str, Any]
    forward_only: bool = False  # logprobs and losses only: no gradients accumulate


@dataclass(frozen=True)
class OptimStepRequest:
    model_id: str
    adam: AdamParams
