"""TrainerController: runs trainer commands (miles.train.commands) on the first alive cell and reports
trainer health; it is the Ray runtime's TrainerClient.

Healthz asks `has_alive_cell()`; once it is False, `health_problem()` says why (e.g. "trainer cell 0
errored: ActorDiedError: ..."). Failures raise RemoteCommandError with the remote cause and traceback;
`is_user_error` tells the gateway to answer with category "user".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from miles.train.cell import TrainerCell
from miles.train.commands import TrainerCommand
from miles.train.errors import TrainerUnavailableError

R = TypeVar("R")


class TrainerController:
    def __init__(self, cells: Sequence[TrainerCell]) -> None:
        if not cells:
            raise ValueError("TrainerController needs at least one trainer cell")
        self.cells = list(cells)

    def alive_cell(self) -> TrainerCell | None:
        return next((cell for cell in self.cells if cell.is_alive), None)

    def has_alive_cell(self) -> bool:
        return self.alive_cell() is not None

    def health_problem(self) -> str | None:
        if self.has_alive_cell():
            return None
        return "; ".join(cell.problem() or f"trainer cell {cell.index} is not alive" for cell in self.cells)

    async def probe_cells(self, timeout_s: float = 10.0) -> bool:
        """Ping every alive cell (dead actors mark their cell errored); True while one is alive."""
        for cell in self.cells:
            if cell.is_alive:
                await cell.probe(timeout_s)
        return self.has_alive_cell()

    async def run(self, command: TrainerCommand[R]) -> R:
        """The TrainerClient of the Ray runtime: `command` on every rank of the first alive cell."""
        cell = self.alive_cell()
        if cell is None:
            raise TrainerUnavailableError(command.name, self.health_problem() or "no trainer cell")
        return await cell.run(command)

    async def run_all(self, command: TrainerCommand[R]) -> list[R]:
        """`command` on every rank of the first alive cell; every rank's answer, rank order (the colocated
        weight push: each rank hands the engine on its GPU its own tensors)."""
        cell = self.alive_cell()
        if cell is None:
            raise TrainerUnavailableError(command.name, self.health_problem() or "no trainer cell")
        return await cell.run_all(command)

    async def stop(self) -> None:
        for cell in self.cells:
            await cell.stop()
