"""The loss functions a forward_backward may name (tinker's `loss_fn`): the gateway refuses any other
before queueing work, and every training backend implements each of them (`miles.train.losses.LOSSES`;
a test holds the two equal)."""

from __future__ import annotations

from typing import Literal, get_args

LossName = Literal[
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
]
LOSS_NAMES: tuple[LossName, ...] = get_args(LossName)
