"""ElasticController: the one owner of borrow and return decisions. Pure: observations in, decisions out.

Borrow when training requests wait while the engines have had no sampling for `idle_window_s`; return
when sampling demand comes back or the training queue drains. Every decision (holds included) carries a
stable code for metrics and a sentence for the log; the runtime carries a decision out at the next step
boundary and reports what happened to the ledger.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from miles.elastic.ledger import GpuLedger, LoanState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticSettings:
    """The preset's `elastic:` section (launcher/presets.py validates it)."""

    enabled: bool = False
    min_rollout_gpus: int = 1
    idle_window_s: float = 30.0
    max_hybrid_lanes: int = 1

    def __post_init__(self) -> None:
        if self.min_rollout_gpus < 0 or self.max_hybrid_lanes < 0 or not self.idle_window_s >= 0:
            raise ValueError(f"bad elastic settings {self}: counts and the idle window must be >= 0")


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    training_waiting: int  # training requests queued behind the one running
    sampling_in_flight: int  # sampling requests queued or running on any engine
    last_sampling_at: float | None  # when sampling was last in flight (None: never)
    busy_engines: frozenset[str] = frozenset()  # engines with requests in flight


Action = Literal["borrow", "return", "hold"]


@dataclass(frozen=True)
class Decision:
    action: Action
    code: str  # stable, for metric labels
    reason: str  # for people
    engine: str | None = None


class ElasticController:
    def __init__(
        self,
        settings: ElasticSettings,
        ledger: GpuLedger,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.settings, self.ledger, self._on_decision = settings, ledger, on_decision
        self.counts: Counter[tuple[Action, str]] = Counter()

    def decide(self, seen: Observation) -> Decision:
        decision = self._decide(seen)
        self.counts[(decision.action, decision.code)] += 1
        level = logging.DEBUG if decision.action == "hold" else logging.INFO
        log.log(level, "elastic %s%s: %s", decision.action, _on(decision.engine), decision.reason)
        if self._on_decision is not None:
            self._on_decision(decision)
        return decision

    def _decide(self, seen: Observation) -> Decision:
        if not self.settings.enabled:
            return Decision("hold", "disabled", "elastic.enabled is false")
        lent = self.ledger.lent()
        if lent:
            latest = lent[-1].engine  # give back in reverse order of lending
            if seen.sampling_in_flight:
                return Decision(
                    "return", "sampling_demand", f"{seen.sampling_in_flight} sampling requests", latest
                )
            if not seen.training_waiting:
                return Decision("return", "queue_drained", "no training request waits", latest)
        if not seen.training_waiting:
            return Decision("hold", "no_training_waiting", "no training request waits")
        idle_for = None if seen.last_sampling_at is None else seen.now - seen.last_sampling_at
        if seen.sampling_in_flight or (idle_for is not None and idle_for < self.settings.idle_window_s):
            return Decision(
                "hold",
                "engines_not_idle",
                f"sampling in flight ({seen.sampling_in_flight}) or idle only {idle_for or 0:.1f} s "
                f"of elastic.idle_window_s {self.settings.idle_window_s}",
            )
        on_loan = [loan for loan in self.ledger.loans.values() if loan.state is not LoanState.SERVING]
        if len(on_loan) >= self.settings.max_hybrid_lanes:
            return Decision("hold", "max_lanes", f"{len(on_loan)} engines on loan = elastic.max_hybrid_lanes")
        return self._pick_engine(seen)

    def _pick_engine(self, seen: Observation) -> Decision:
        refusals = []
        for name in sorted(self.ledger.loans):
            if name in seen.busy_engines:
                refusals.append(f"engine {name} has requests in flight")
                continue
            refusal = self.ledger.refusal(name)
            if refusal is None:
                return Decision(
                    "borrow", "idle_engines", f"{seen.training_waiting} training requests wait", name
                )
            refusals.append(refusal)
        return Decision("hold", "no_lendable_engine", "; ".join(refusals) or "no engines")


def _on(engine: str | None) -> str:
    return f" engine {engine}" if engine else ""
