"""The GPU ownership ledger: every GPU has one owner (an engine, a hybrid lane, or nobody) at all times.

An engine is lent whole or not at all, and only an engine on one host. Each engine's loan moves through
an explicit state machine (TRANSITIONS); a GPU's owner follows from its engine's state:

    SERVING    --drain------------> DRAINING    owner: the engine (paused, requests draining)
    DRAINING   --cannot_free------> SERVING     the engine keeps serving; the shortfall is recorded
    DRAINING   --freed------------> FREED       owner: nobody (engine stopped, memory released)
    FREED      --lane_started-----> LENT        owner: the hybrid lane
    FREED      --lane_failed------> RETURNING   owner: nobody (the engine comes back)
    LENT       --lane_stopped-----> RETURNING
    RETURNING  --serving----------> SERVING     only once the engine holds the current weights
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class LoanState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    FREED = "freed"
    LENT = "lent"
    RETURNING = "returning"


TRANSITIONS: dict[tuple[LoanState, str], LoanState] = {
    (LoanState.SERVING, "drain"): LoanState.DRAINING,
    (LoanState.DRAINING, "cannot_free"): LoanState.SERVING,
    (LoanState.DRAINING, "freed"): LoanState.FREED,
    (LoanState.FREED, "lane_started"): LoanState.LENT,
    (LoanState.FREED, "lane_failed"): LoanState.RETURNING,
    (LoanState.LENT, "lane_stopped"): LoanState.RETURNING,
    (LoanState.RETURNING, "serving"): LoanState.SERVING,
}


class LedgerError(RuntimeError):
    """A transition the table does not allow, or a GPU claimed twice."""


@dataclass(frozen=True)
class Gpu:
    host: str
    index: int

    def __str__(self) -> str:
        return f"{self.host}:{self.index}"


@dataclass
class EngineLoan:
    engine: str
    gpus: tuple[Gpu, ...]
    state: LoanState = LoanState.SERVING
    lane: str | None = None

    @property
    def owner(self) -> str:
        if self.state in (LoanState.SERVING, LoanState.DRAINING):
            return f"engine:{self.engine}"
        if self.state is LoanState.LENT:
            return f"lane:{self.lane}"
        return "free"

    @property
    def hosts(self) -> set[str]:
        return {gpu.host for gpu in self.gpus}


@dataclass
class GpuLedger:
    min_rollout_gpus: int
    loans: dict[str, EngineLoan] = field(default_factory=dict)
    shortfalls: list[str] = field(default_factory=list)  # engines that could not be freed, and why

    def add_engine(self, engine: str, gpus: Iterable[Gpu]) -> None:
        gpus = tuple(gpus)
        if not gpus:
            raise LedgerError(f"engine {engine} holds no GPU")
        claimed = {gpu for loan in self.loans.values() for gpu in loan.gpus}
        twice = sorted(str(gpu) for gpu in gpus if gpu in claimed)
        if engine in self.loans or twice:
            raise LedgerError(f"engine {engine}: already in the ledger or GPUs owned already: {twice}")
        self.loans[engine] = EngineLoan(engine, gpus)

    def owners(self) -> dict[Gpu, str]:
        return {gpu: loan.owner for loan in self.loans.values() for gpu in loan.gpus}

    def serving_gpus(self, excluding: str | None = None) -> int:
        return sum(
            len(loan.gpus)
            for name, loan in self.loans.items()
            if loan.state is LoanState.SERVING and name != excluding
        )

    def lent(self) -> list[EngineLoan]:
        return [loan for loan in self.loans.values() if loan.state is LoanState.LENT]

    def refusal(self, engine: str) -> str | None:
        """Why `engine` may not be lent now (None: it may)."""
        loan = self.loans.get(engine)
        if loan is None:
            return f"unknown engine {engine!r}"
        if loan.state is not LoanState.SERVING:
            return f"engine {engine} is {loan.state.value}, not serving"
        if len(loan.hosts) != 1:
            return f"engine {engine} spans hosts {sorted(loan.hosts)}: only a one-host engine is lent"
        left = self.serving_gpus(excluding=engine)
        if left < self.min_rollout_gpus:
            return (
                f"lending engine {engine} leaves {left} rollout GPUs, "
                f"below elastic.min_rollout_gpus {self.min_rollout_gpus}"
            )
        return None

    def _move(self, engine: str, event: str) -> EngineLoan:
        loan = self.loans[engine]
        target = TRANSITIONS.get((loan.state, event))
        if target is None:
            raise LedgerError(f"engine {engine}: {event} is not allowed when {loan.state.value}")
        loan.state = target
        return loan

    def drain(self, engine: str) -> None:
        reason = self.refusal(engine)
        if reason is not None:
            raise LedgerError(reason)
        self._move(engine, "drain")

    def cannot_free(self, engine: str, why: str) -> None:
        self._move(engine, "cannot_free")
        self.shortfalls.append(f"{engine}: {why}")

    def freed(self, engine: str) -> None:
        self._move(engine, "freed")

    def lane_started(self, engine: str, lane: str) -> None:
        self._move(engine, "lane_started").lane = lane

    def lane_failed(self, engine: str) -> None:
        self._move(engine, "lane_failed")

    def lane_stopped(self, engine: str) -> None:
        self._move(engine, "lane_stopped").lane = None

    def serving(self, engine: str) -> None:
        self._move(engine, "serving")
