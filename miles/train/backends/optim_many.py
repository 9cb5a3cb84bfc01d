"""Several models' optim_steps in one trainer command: each model's step is exactly its own optim_step
(its own AdamW, hyperparameters and clipping; the same ops in the same order), but every step is queued
on the device before any gradient norm is read, so the host waits for the device once, not once per model.

A request that fails (bad adam_params, unknown model, out of memory while preparing: nothing of it
changed) is its own outcome; the others step. Every data-parallel rank runs the requests in the same order,
so the collectives of each step (the gradient all-reduce, the agreement on a preparation failure) match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from miles.errors import UserError
from miles.train.backends import optim
from miles.types import AdamParams

if TYPE_CHECKING:
    from miles.train.commands import OptimStep

Outcome = dict[str, float] | UserError
StartStep = Callable[[str, AdamParams], torch.Tensor]


def optim_step_many(start_step: StartStep, requests: Sequence[OptimStep]) -> list[Outcome]:
    """One outcome per request, in order. `start_step(key, adam)` queues one model's step and returns its
    gradient norm unread (TransformersBackend._start_optim_step)."""
    keys = [request.key for request in requests]
    if len(set(keys)) != len(keys):  # two steps of one model would be one step of it, out of order
        raise ValueError(f"optim_step_many got one model twice: {keys}")
    started: list[torch.Tensor | UserError] = []
    for request in requests:
        try:
            started.append(start_step(request.key, request.adam))
        except UserError as exc:
            started.append(exc)
    return [
        norm if isinstance(norm, UserError) else optim.step_metrics(norm, request.adam)
        for norm, request in zip(started, requests, strict=True)
    ]
