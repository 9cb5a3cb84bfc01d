"""The GPU ownership ledger and the ElasticController's decisions (pure)."""

from __future__ import annotations

import logging

import pytest

from miles.contract.preset.runtime import ElasticOptions
from miles.elastic.ledger import TRANSITIONS, Gpu, GpuLedger, LedgerError, LoanState
from miles.elastic.policy import Decision, ElasticController, Observation


def ledger(min_rollout_gpus: int = 2) -> GpuLedger:
    book = GpuLedger(min_rollout_gpus)
    book.add_engine("e0", [Gpu("n1", 0), Gpu("n1", 1)])
    book.add_engine("e1", [Gpu("n1", 2), Gpu("n1", 3)])
    book.add_engine("wide", [Gpu("n2", 0), Gpu("n3", 0)])  # a TP engine across two hosts
    return book


def test_a_loan_moves_gpus_from_engine_to_free_to_lane_and_back_with_one_owner_each() -> None:
    book = ledger()
    e0 = [Gpu("n1", 0), Gpu("n1", 1)]
    seen = []
    for step in (
        lambda: book.drain("e0"),
        lambda: book.freed("e0"),
        lambda: book.lane_started("e0", "lane-1"),
        lambda: book.lane_stopped("e0"),
        lambda: book.serving("e0"),
    ):
        step()
        owners = book.owners()
        assert len(owners) == 6  # every GPU has exactly one owner at every point
        seen.append({owners[gpu] for gpu in e0})
    assert seen == [{"engine:e0"}, {"free"}, {"lane:lane-1"}, {"free"}, {"engine:e0"}]
    assert book.owners()[Gpu("n1", 2)] == "engine:e1"


def test_claims_and_transitions_outside_the_table_are_refused() -> None:
    book = ledger()
    with pytest.raises(LedgerError, match="owned already"):
        book.add_engine("e9", [Gpu("n1", 1)])
    with pytest.raises(LedgerError, match="lane_started is not allowed when serving"):
        book.lane_started("e0", "lane-1")
    book.drain("e0")
    with pytest.raises(LedgerError, match="serving is not allowed when draining"):
        book.serving("e0")
    assert all(state in LoanState for state in TRANSITIONS.values())


def test_reserve_and_host_rules_refuse_a_borrow_and_an_unfreeable_engine_keeps_serving() -> None:
    book = ledger(min_rollout_gpus=4)
    assert "spans hosts" in book.refusal("wide")
    assert book.refusal("e0") is None  # e1 + wide keep 4
    book.drain("e0")
    assert "below elastic.min_rollout_gpus 4" in book.refusal("e1")  # only wide's 2 would be left
    with pytest.raises(LedgerError, match="min_rollout_gpus"):
        book.drain("e1")
    book.cannot_free("e0", "2 requests could not be drained")
    assert book.loans["e0"].state is LoanState.SERVING
    assert book.shortfalls == ["e0: 2 requests could not be drained"]
    assert book.owners()[Gpu("n1", 0)] == "engine:e0"


def test_a_failed_lane_start_gives_the_gpus_back_to_the_engine() -> None:
    book = ledger()
    book.drain("e1")
    book.freed("e1")
    book.lane_failed("e1")
    assert book.owners()[Gpu("n1", 2)] == "free"
    book.serving("e1")
    assert book.loans["e1"].state is LoanState.SERVING and book.loans["e1"].lane is None


SETTINGS = ElasticOptions(enabled=True, min_rollout_gpus=2, idle_window_s=10.0, max_hybrid_lanes=1)


def observe(now: float = 100.0, waiting: int = 3, sampling: int = 0, last: float | None = 50.0, busy=()):
    return Observation(now, waiting, sampling, last, frozenset(busy))


def test_borrow_only_when_training_waits_and_engines_idled_for_the_window(caplog) -> None:
    decided: list[Decision] = []
    control = ElasticController(SETTINGS, ledger(), decided.append)
    assert control.decide(observe(waiting=0)).code == "no_training_waiting"
    assert control.decide(observe(sampling=2)).code == "engines_not_idle"
    assert control.decide(observe(now=55.0)).code == "engines_not_idle"  # idle 5 s of 10
    assert control.decide(observe(busy={"e0"})) == Decision(
        "borrow", "idle_engines", "3 training requests wait", "e1"
    )
    with caplog.at_level(logging.INFO, logger="miles.elastic.policy"):
        first = control.decide(observe(last=None))
    assert (first.action, first.engine) == ("borrow", "e0")
    assert "elastic borrow engine e0: 3 training requests wait" in caplog.text
    assert control.counts[("hold", "engines_not_idle")] == 2 and len(decided) == 5


def test_the_reserve_max_lanes_and_disabled_hold() -> None:
    book = ledger(min_rollout_gpus=6)
    control = ElasticController(SETTINGS, book)
    held = control.decide(observe())
    assert (
        held.code == "no_lendable_engine"
        and "spans hosts" in held.reason
        and "min_rollout_gpus" in held.reason
    )
    book = ledger()
    book.drain("e0")
    assert ElasticController(SETTINGS, book).decide(observe()).code == "max_lanes"
    assert ElasticController(ElasticOptions(), ledger()).decide(observe()).code == "disabled"


def test_return_when_sampling_comes_back_or_the_queue_drains_latest_loan_first() -> None:
    book = ledger(min_rollout_gpus=0)
    for engine, lane in (("e0", "l0"), ("e1", "l1")):
        book.drain(engine)
        book.freed(engine)
        book.lane_started(engine, lane)
    control = ElasticController(SETTINGS, book)
    assert control.decide(observe(sampling=1)) == Decision(
        "return", "sampling_demand", "1 sampling requests", "e1"
    )
    assert control.decide(observe(waiting=0)).engine == "e1"
    book.lane_stopped("e1")
    assert control.decide(observe(waiting=0)) == Decision(
        "return", "queue_drained", "no training request waits", "e0"
    )


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="idle_window_s"):
        ElasticOptions(idle_window_s=-1)


def test_decisions_and_owners_reach_the_metrics_registry() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from miles.elastic.metrics import ElasticMetrics

    registry = CollectorRegistry()
    metrics = ElasticMetrics(registry)
    book = ledger(min_rollout_gpus=0)
    control = ElasticController(SETTINGS, book, metrics.count)
    control.decide(observe())
    control.decide(observe(waiting=0))
    book.drain("e0")
    book.cannot_free("e0", "requests would not drain")
    book.drain("e1")
    book.freed("e1")
    book.lane_started("e1", "lane-1")
    metrics.observe_ledger(book)
    metrics.observe_ledger(book)  # a shortfall is counted once
    text = generate_latest(registry).decode()
    assert 'miles_elastic_decisions_total{action="borrow",reason="idle_engines"} 1.0' in text
    assert 'miles_elastic_decisions_total{action="hold",reason="no_training_waiting"} 1.0' in text
    assert 'miles_elastic_gpu_owner{owner="lane"} 2.0' in text
    assert 'miles_elastic_gpu_owner{owner="engine"} 4.0' in text
    assert "miles_elastic_shortfalls_total 1.0" in text


def lent(book: GpuLedger, engine: str, lane: str) -> None:
    """What the LoanExecutor does to the ledger once a borrow succeeded."""
    book.drain(engine)
    book.freed(engine)
    book.lane_started(engine, lane)


def test_a_loan_is_kept_for_min_loan_s_before_sampling_or_an_empty_queue_takes_it_back() -> None:
    book = ledger(min_rollout_gpus=0)
    settings = ElasticOptions(enabled=True, min_rollout_gpus=0, idle_window_s=10.0, min_loan_s=30.0)
    control = ElasticController(settings, book)
    assert control.decide(observe(now=100.0)) == Decision(
        "borrow", "idle_engines", "3 training requests wait", "e0"
    )
    lent(book, "e0", "lane-e0")
    for seen in (observe(now=110.0, sampling=2), observe(now=129.9, waiting=0)):
        held = control.decide(seen)
        assert (held.action, held.code, held.engine) == ("hold", "min_loan", "e0")
        assert "elastic.min_loan_s 30.0" in held.reason
    assert control.decide(observe(now=130.0, sampling=2)).code == "sampling_demand"
    assert control.decide(observe(now=130.0, waiting=0)) == Decision(
        "return", "queue_drained", "no training request waits", "e0"
    )
    assert control.decide(observe(now=115.0)).code == "max_lanes"  # training waits: kept, no second loan
    assert control.counts[("hold", "min_loan")] == 2


def test_a_dead_lanes_engine_goes_back_at_once_whatever_the_loans_age_or_the_queue() -> None:
    book = ledger(min_rollout_gpus=0)
    settings = ElasticOptions(enabled=True, min_rollout_gpus=0, max_hybrid_lanes=2, min_loan_s=600.0)
    control = ElasticController(settings, book)
    for engine in ("e0", "e1"):
        assert control.decide(observe(now=100.0)).engine == engine
        lent(book, engine, f"lane-{engine}")
    seen = Observation(101.0, 5, 0, None, frozenset(), dead_lanes=frozenset({"lane-e0", "gone-long-ago"}))
    assert control.decide(seen) == Decision("return", "lane_died", "lane lane-e0 died", "e0")
    book.lane_stopped("e0")
    assert control.decide(seen).code == "max_lanes"  # e1's lane lives: kept (600 s loans, training waits)


def test_bad_minimum_loans_are_refused() -> None:
    with pytest.raises(ValueError, match="min_loan_s"):
        ElasticOptions(min_loan_s=-0.5)


# ---- pinned by the planning mutation run (docs/testing.md, "Mutation testing") ----------------------------


def test_an_engine_without_gpus_is_refused_and_a_double_claim_names_the_gpus() -> None:
    book = ledger()
    with pytest.raises(LedgerError, match="engine e9 holds no GPU"):
        book.add_engine("e9", [])
    with pytest.raises(LedgerError, match=r"owned already: \['n1:1', 'n1:3'\]"):
        book.add_engine("e9", [Gpu("n1", 3), Gpu("n1", 1), Gpu("n4", 0)])
    assert "e9" not in book.loans


def test_a_stopped_lane_leaves_the_loan_without_a_lane() -> None:
    book = ledger()
    lent(book, "e0", "lane-1")
    assert book.loans["e0"].lane == "lane-1"
    book.lane_stopped("e0")
    assert book.loans["e0"].state is LoanState.RETURNING and book.loans["e0"].lane is None


def test_every_refusal_to_lend_is_a_hold() -> None:
    assert ElasticController(ElasticOptions(), ledger()).decide(observe()) == Decision(
        "hold", "disabled", "elastic.enabled is false"
    )
    book = ledger()
    book.drain("e0")
    full = ElasticController(SETTINGS, book).decide(observe())
    assert (full.action, full.code, full.engine) == ("hold", "max_lanes", None)
    busy = ElasticController(SETTINGS, ledger()).decide(observe(busy={"e0", "e1"}))
    assert (busy.action, busy.code, busy.engine) == ("hold", "no_lendable_engine", None)
    assert "engine e0 has requests in flight" in busy.reason and "engine e1 has requests" in busy.reason


def test_an_engine_idle_exactly_the_idle_window_may_be_borrowed() -> None:
    control = ElasticController(SETTINGS, ledger())  # idle_window_s 10
    assert control.decide(observe(now=100.0, last=90.5)).code == "engines_not_idle"
    assert control.decide(observe(now=100.0, last=90.0)) == Decision(
        "borrow", "idle_engines", "3 training requests wait", "e0"
    )
