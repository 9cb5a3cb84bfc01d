"""InProcessTrainer: the TrainerClient over one backend in this process (the LocalRuntime's trainer).

Commands run in a worker thread (`asyncio.to_thread`), so the event loop never blocks, and one at a time:
adapters share the base model. The lock is a thread lock held by the worker thread itself, so a caller
that is cancelled (an execution timeout) cannot release it while its computation still runs.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

from miles.train.backends.base import TrainBackend
from miles.train.commands import TrainerCommand

R = TypeVar("R")


class InProcessTrainer:
    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend
        self._compute = threading.Lock()

    async def run(self, command: TrainerCommand[R]) -> R:
        return await asyncio.to_thread(self._run_exclusive, command)

    def _run_exclusive(self, command: TrainerCommand[R]) -> R:
        with self._compute:
            return command.run(self.backend)
