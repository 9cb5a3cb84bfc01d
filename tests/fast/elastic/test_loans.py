"""LoanExecutor: a borrow or a return moves the engine, the lane and the ledger together or not at all.
The ports are small recording doubles (this is the orchestration's unit test; the parts have their own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.elastic.ledger import Gpu, GpuLedger, LoanState
from miles.elastic.loans import LoanExecutor


@dataclass
class Calls:
    log: list[str] = field(default_factory=list)


class Engine:
    def __init__(self, calls: Calls, name: str, *, drain: str | None = None, release_error: bool = False):
        self.calls, self.name, self._drain, self._release_error = calls, name, drain, release_error

    async def drain(self, timeout_s: float) -> str | None:
        self.calls.log.append(f"drain {self.name}")
        return self._drain

    async def release(self) -> None:
        self.calls.log.append(f"release {self.name}")
        if self._release_error:
            raise RuntimeError("GPU memory still held")

    async def restore(self) -> None:
        self.calls.log.append(f"restore {self.name}")


@dataclass
class LaneHandle:
    name: str


class Lanes:
    def __init__(self, calls: Calls, *, start_error: bool = False) -> None:
        self.calls, self.start_error = calls, start_error

    async def start(self, engine: str) -> LaneHandle:
        self.calls.log.append(f"start lane on {engine}")
        if self.start_error:
            raise RuntimeError("lane actor died during setup")
        return LaneHandle(f"lane-{engine}")

    async def stop(self, lane: LaneHandle) -> None:
        self.calls.log.append(f"stop {lane.name}")


class Trainer:
    def __init__(self, calls: Calls, *, join_error: bool = False, leave_error: bool = False) -> None:
        self.calls, self.join_error, self.leave_error = calls, join_error, leave_error

    async def join(self, lane: LaneHandle) -> None:
        self.calls.log.append(f"join {lane.name}")
        if self.join_error:
            raise RuntimeError("state transfer timed out")

    async def leave(self, name: str) -> None:
        self.calls.log.append(f"leave {name}")
        if self.leave_error:
            raise RuntimeError("pending gradients")


def setup(calls: Calls, engine: Engine | None = None, lanes=None, trainer=None) -> LoanExecutor:
    ledger = GpuLedger(min_rollout_gpus=1)
    ledger.add_engine("e0", [Gpu("n1", 0)])
    ledger.add_engine("e1", [Gpu("n1", 1)])
    engines = {"e0": engine or Engine(calls, "e0"), "e1": Engine(calls, "e1")}
    return LoanExecutor(ledger, trainer or Trainer(calls), lanes or Lanes(calls), engines)


async def test_borrow_then_return_in_order_with_phases() -> None:
    calls = Calls()
    loans = setup(calls)
    lent = await loans.borrow("e0")
    assert lent.ok and list(lent.phases) == ["drain", "free", "start", "state_transfer"]
    assert loans.ledger.owners()[Gpu("n1", 0)] == "lane:lane-e0"
    back = await loans.give_back("e0")
    assert back.ok and list(back.phases) == ["leave", "stop_lane", "serving"]
    assert calls.log == [
        "drain e0", "release e0", "start lane on e0", "join lane-e0",
        "leave lane-e0", "stop lane-e0", "restore e0",
    ]  # fmt: skip
    assert loans.ledger.owners()[Gpu("n1", 0)] == "engine:e0"


async def test_an_engine_that_cannot_drain_or_release_keeps_serving_and_the_shortfall_is_recorded() -> None:
    calls = Calls()
    loans = setup(calls, Engine(calls, "e0", drain="3 requests still running after 30 s"))
    outcome = await loans.borrow("e0")
    assert not outcome.ok and "3 requests still running" in outcome.reason
    assert loans.ledger.loans["e0"].state is LoanState.SERVING
    assert loans.ledger.shortfalls == ["e0: 3 requests still running after 30 s"]
    calls = Calls()
    loans = setup(calls, Engine(calls, "e0", release_error=True))
    outcome = await loans.borrow("e0")
    assert not outcome.ok and "GPU memory still held" in outcome.reason
    assert calls.log == ["drain e0", "release e0", "restore e0"]  # restored before it serves again
    assert loans.ledger.owners()[Gpu("n1", 0)] == "engine:e0"


async def test_a_lane_that_fails_to_start_or_join_is_rolled_back_to_the_serving_engine() -> None:
    for lanes_error, trainer_error, expected in (
        (True, False, ["drain e0", "release e0", "start lane on e0", "restore e0"]),
        (
            False,
            True,
            ["drain e0", "release e0", "start lane on e0", "join lane-e0", "stop lane-e0", "restore e0"],
        ),
    ):
        calls = Calls()
        loans = setup(
            calls,
            lanes=Lanes(calls, start_error=lanes_error),
            trainer=Trainer(calls, join_error=trainer_error),
        )
        before = loans.ledger.owners()
        outcome = await loans.borrow("e0")
        assert not outcome.ok and "engine restored" in outcome.reason and "rollback" in outcome.phases
        assert calls.log == expected
        assert loans.ledger.owners() == before and loans.ledger.loans["e0"].state is LoanState.SERVING


async def test_refused_borrows_touch_nothing_and_a_failed_leave_keeps_the_lane_lent() -> None:
    calls = Calls()
    loans = setup(calls)
    assert (await loans.borrow("e0")).ok
    refused = await loans.borrow("e1")  # would leave 0 rollout GPUs
    assert not refused.ok and "min_rollout_gpus" in refused.reason
    assert calls.log == ["drain e0", "release e0", "start lane on e0", "join lane-e0"]
    loans.trainer.leave_error = True
    outcome = await loans.give_back("e0")
    assert not outcome.ok and "lane stays lent" in outcome.reason
    assert loans.ledger.owners()[Gpu("n1", 0)] == "lane:lane-e0"
    assert not (await loans.give_back("e1")).ok  # never lent
