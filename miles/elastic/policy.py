"""ElasticController: the one owner of borrow and return decisions. Pure: observations in, decisions out.

Borrow when training requests wait while the engines have had no sampling for `idle_window_s`; return
when sampling demand comes back or the training queue drains, but not before the loan is
`min_loan_s` old (a loop training one step at a time would otherwise pay a borrow and a return every
step); an engine whose lane died goes back at once. Every decision (holds included) carries a
stable code for metrics and a sentence for the log; the runtime carries a decision out at the next step
boundary and reports what happened to the ledger.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from miles.contract.preset.runtime import ElasticOptions
from miles.elastic.ledger import GpuLedger, LoanState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    training_waiting: int  # training requests queued behind the one running
    sampling_in_flight: int  # sampling requests queued or running on any engine
    last_sampling_at: float | None  # when sampling was last in flight (None: never)
    busy_engines: frozenset[str] = frozenset()  # engines with requests in flight
    dead_lanes: frozenset[str] = frozenset()  # lanes that died (dropped by the trainer's recovery)


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
        settings: ElasticOptions,
        ledger: GpuLedger,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.settings, self.ledger, self._on_decision = settings, ledger, on_decision
        self.counts: Counter[tuple[Action, str]] = Counter()
        self._borrowed_at: dict[str, float] = {}  # engine -> when this controller decided its borrow

    def decide(self, seen: Observation) -> Decision:
        decision = self._decide(seen)
        self.counts[(decision.action, decision.code)] += 1
        level = logging.DEBUG if decision.action == "hold" else logging.INFO
        log.log(level, "elastic %s%s: %s", decision.action, _on(decision.engine), decision.reason)
        if self._on_decision is not None:
            self._on_decision(decision)
        if decision.action == "borrow" and decision.engine is not None:
            self._borrowed_at[decision.engine] = seen.now
        return decision

    def _decide(self, seen: Observation) -> Decision:
        if not self.settings.enabled:
            return Decision("hold", "disabled", "elastic.enabled is false")
        lent = self.ledger.lent()
        orphaned = [loan for loan in lent if loan.lane in seen.dead_lanes]
        if orphaned:  # a dead lane trains nothing: its engine goes back whatever the loan's age
            loan = orphaned[0]
            return Decision("return", "lane_died", f"lane {loan.lane} died", loan.engine)
        if lent:
            returning = self._return(seen, lent[-1].engine)  # give back in reverse order of lending
            if returning is not None:
                return returning
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

    def _return(self, seen: Observation, engine: str) -> Decision | None:
        """Give `engine` back when sampling or the queue asks for it and its loan has lasted long enough."""
        if seen.sampling_in_flight:
            demand = f"{seen.sampling_in_flight} sampling requests"
            wanted = Decision("return", "sampling_demand", demand, engine)
        elif not seen.training_waiting:
            wanted = Decision("return", "queue_drained", "no training request waits", engine)
        else:
            return None
        age = seen.now - self._borrowed_at.get(engine, float("-inf"))
        if age < self.settings.min_loan_s:
            return Decision(
                "hold",
                "min_loan",
                f"{wanted.reason}, but engine {engine} is lent only {age:.1f} s of elastic.min_loan_s "
                f"{self.settings.min_loan_s}",
                engine,
            )
        return wanted

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
