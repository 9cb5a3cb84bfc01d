"""An engine cell as LoanExecutor's EnginePort: drained through the engine's own flush (SGLang and the CPU
engine refuse to flush while a request runs), released by stopping its process (cell state LENT), and
restored the way a respawn is: started on its bundle, then given the current weights before it is READY.

Drain and release run inside the InferenceController's weight-update bracket (the caller's
`controller.weight_update(base_weights=False)`: no push, respawn or health probe in between, the other
engines keep serving); restore runs outside it, since `refresh_weights` takes the bracket itself.
"""

from __future__ import annotations

from typing import Any

from miles.engines.errors import EngineRefused
from miles.rollout.cell_state import CellState


class EngineCellPort:
    def __init__(self, controller: Any, cell: Any) -> None:
        self.controller, self.cell = controller, cell

    async def drain(self, timeout_s: float) -> str | None:
        cell = self.cell
        if cell.state is not CellState.READY:
            return f"{cell.name} is {cell.state.value}, not ready"
        cell.mark_pending()  # out of routing now: no new request reaches it
        try:
            await cell.client.flush_cache(timeout_s=timeout_s)  # returns once nothing runs there
        except EngineRefused:
            cell.mark_ready()  # its weights never changed: it serves again as it was
            return f"{cell.name} still had requests running after {timeout_s:.0f} s"
        return None

    async def release(self) -> None:
        await self.cell.lend()

    async def restore(self) -> None:
        if self.cell.state is not CellState.PENDING_WEIGHTS:
            await self.cell.start()
        await self.controller.refresh_weights()  # the current weights before it is routed to again
