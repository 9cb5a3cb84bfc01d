"""Trainer commands in a job with elastic training: what the lanes must see goes through HybridTrainer.

A training forward_backward is split across the live lanes and an optimizer step reduces over them
(HybridTrainer); an adapter is created on every lane; a change to the core's state outside a step (a
reset, a loaded checkpoint) is copied to every lane. Everything else (exports, saves, forward-only passes,
the weight push's rank-0 commands) reads the core trainer alone, whose state every lane equals.
"""

from __future__ import annotations

from typing import Any

from miles.train.commands import (
    CreateAdapter,
    ForwardBackward,
    LoadState,
    OptimStep,
    RemoveAdapter,
    Reset,
    TrainerCommand,
)
from miles.train.controller import TrainerController
from miles.train.hybrid.coordinator import HybridTrainer


class HybridRouter:
    def __init__(self, trainer: TrainerController, hybrid: HybridTrainer) -> None:
        self.trainer, self.hybrid = trainer, hybrid

    async def run(self, command: TrainerCommand[Any]) -> Any:
        hybrid = self.hybrid
        match command:
            case ForwardBackward(forward_only=False):
                return await hybrid.forward_backward(
                    command.key, list(command.data), command.loss_fn, command.loss_config
                )
            case OptimStep():
                return await hybrid.optim_step(command.key, command.adam)
            case CreateAdapter():
                return await hybrid.create_adapter(command.key, command.spec)
            case RemoveAdapter():
                result = await self.trainer.run(command)
                await hybrid.remove_adapter(command.key)
                return result
            case Reset() | LoadState():
                result = await self.trainer.run(command)
                await hybrid.resync()
                return result
        return await self.trainer.run(command)
