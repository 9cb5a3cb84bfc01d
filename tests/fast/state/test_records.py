"""Typed records and repositories, on both stores."""

from __future__ import annotations

import asyncio

import pytest

from miles.errors import IllegalTransition
from miles.state import StateStore
from miles.state.claims import DedupClaims, claim_ttl_s
from miles.state.futures import FUTURE_TRANSITIONS, FutureRepository, FutureState
from miles.state.records import (
    SESSION_TRANSITIONS,
    ModelRecord,
    ModelRepository,
    SamplerRecord,
    SamplerRepository,
    SessionRecord,
    SessionRepository,
    SessionState,
    check_transition,
)


class TickingClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def session(session_id: str = "s1", tenant: str = "alice") -> SessionRecord:
    return SessionRecord(session_id=session_id, tenant=tenant, created_at=1.0, last_heartbeat=1.0, tags=["x"])


async def test_session_create_heartbeat_finish(store: StateStore) -> None:
    repo = SessionRepository(store, clock=TickingClock())
    assert await repo.create(session())
    assert not await repo.create(session(tenant="mallory")), "a second create must not overwrite"
    beat = await repo.heartbeat("s1")
    assert beat is not None and beat.last_heartbeat > 1.0 and beat.tenant == "alice"
    done, ended_now = await repo.end("s1", SessionState.FINISHED, "success", "bye")
    assert ended_now and done.state is SessionState.FINISHED and done.finish_reason == "success"
    again, ended_again = await repo.end("s1", SessionState.FINISHED, "errored")
    assert not ended_again and again.finish_reason == "success" and again.ended_at == done.ended_at
    after = await repo.heartbeat("s1")
    assert after.last_heartbeat == beat.last_heartbeat, "a finished session takes no heartbeats"
    assert await repo.heartbeat("nope") is None


async def test_get_owned_hides_other_tenants(store: StateStore) -> None:
    repo = SessionRepository(store)
    await repo.create(session("s1", "alice"))
    await repo.create(session("s2", "bob"))
    assert (await repo.get_owned("alice", "s1")).session_id == "s1"
    assert await repo.get_owned("bob", "s1") is None
    assert [s.session_id for s in await repo.list(tenant="bob")] == ["s2"]
    assert [s.session_id for s in await repo.list()] == ["s1", "s2"]


async def test_model_record_roundtrip_and_touch(store: StateStore) -> None:
    repo = ModelRepository(store, clock=TickingClock())
    rec = ModelRecord(
        model_id="s1:train:0",
        tenant="alice",
        session_id="s1",
        base_model="tiny",
        is_lora=True,
        lora_rank=8,
        created_at=1.0,
        last_request_time=1.0,
        user_metadata={"renderer_name": "qwen3"},
    )
    assert await repo.create(rec)
    assert await repo.get("s1:train:0") == rec
    touched = await repo.touch("s1:train:0")
    assert touched.last_request_time > 1.0
    assert [m.model_id for m in await repo.list(prefix="s1:")] == ["s1:train:0"]


async def test_sampler_record_keeps_an_ephemeral_snapshot_and_loads_without_one(store: StateStore) -> None:
    repo = SamplerRepository(store)
    ephemeral = SamplerRecord(
        sampling_session_id="s1:sample:0",
        tenant="alice",
        base_model="tiny",
        created_at=1.0,
        session_id="s1",
        model_id="s1:train:0",
        ephemeral_snapshot="tinker://s1:train:0/sampler_weights/ephemeral:0",
    )
    await repo.save(ephemeral)
    assert await repo.get("s1:sample:0") == ephemeral
    # a record stored before the field existed loads as a sampler on a saved snapshot
    old = {"sampling_session_id": "s1:sample:1", "tenant": "alice", "base_model": "tiny", "created_at": 1.0}
    await store.put(SamplerRepository.namespace, "s1:sample:1", {**old, "model_path": "tinker://m/x/y"})
    loaded = await repo.get("s1:sample:1")
    assert loaded is not None and loaded.ephemeral_snapshot is None and loaded.model_path == "tinker://m/x/y"


def test_transition_table_has_final_terminal_states() -> None:
    for terminal in (FutureState.COMPLETE, FutureState.FAILED):
        assert FUTURE_TRANSITIONS[terminal] == frozenset()
        for target in FutureState:
            with pytest.raises(IllegalTransition):
                check_transition(FUTURE_TRANSITIONS, terminal, target)
    check_transition(FUTURE_TRANSITIONS, FutureState.PENDING, FutureState.RUNNING)
    with pytest.raises(IllegalTransition):
        check_transition(FUTURE_TRANSITIONS, FutureState.RUNNING, FutureState.PENDING)


async def test_future_lifecycle_with_bytes_result(store: StateStore) -> None:
    repo = FutureRepository(store, clock=TickingClock())
    await repo.open("req-1", "alice", "ForwardBackward", model_id="s1:train:0")
    running = await repo.mark_running("req-1")
    assert running.state is FutureState.RUNNING and not running.done
    payload = bytes(range(256))
    done = await repo.complete("req-1", payload)
    assert done.done and done.result_bytes() == payload
    assert (await repo.get("req-1")).result_bytes() == payload
    for move in (repo.mark_running("req-1"), repo.fail("req-1", "late"), repo.complete("req-1", {})):
        with pytest.raises(IllegalTransition):
            await move
    assert (await repo.get("req-1")).state is FutureState.COMPLETE


async def test_future_failure_is_final_and_keeps_category(store: StateStore) -> None:
    repo = FutureRepository(store)
    await repo.open("req-2", "alice", "OptimStep")
    failed = await repo.fail("req-2", "bad loss input", "user")
    assert failed.error.message == "bad loss input" and failed.error.category == "user"
    with pytest.raises(IllegalTransition):
        await repo.complete("req-2", {"metrics": {}})
    with pytest.raises(IllegalTransition):
        await repo.mark_running("req-2")
    with pytest.raises(KeyError):
        await repo.complete("missing", {})


async def test_future_json_result_and_duplicate_open(store: StateStore) -> None:
    repo = FutureRepository(store)
    await repo.open("req-3", "alice", "Sample", sample_sequence_ids=["a", "b"])
    with pytest.raises(Exception, match="already exists"):
        await repo.open("req-3", "alice", "Sample")
    done = await repo.complete("req-3", {"path": "tinker://m/weights/x"})
    assert done.result_value() == {"path": "tinker://m/weights/x"} and done.result_bytes() is None
    assert (await repo.get("req-3")).sample_sequence_ids == ["a", "b"]


async def test_concurrent_completion_has_one_winner(store: StateStore) -> None:
    repo = FutureRepository(store)
    await repo.open("req-4", "alice", "OptimStep")
    outcomes = await asyncio.gather(
        *(repo.complete("req-4", {"by": i}) for i in range(8)), return_exceptions=True
    )
    winners = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(o, IllegalTransition) for o in outcomes if isinstance(o, BaseException))
    assert (await repo.get("req-4")).result_json == winners[0].result_json


async def test_future_result_json_keeps_nan_that_store_values_refuse(store: StateStore) -> None:
    repo = FutureRepository(store)
    await repo.open("req-5", "alice", "OptimStep")
    await repo.complete("req-5", {"metrics": {"loss": float("nan")}})
    stored = await repo.get("req-5")
    assert stored.result_json == '{"metrics": {"loss": NaN}}'
    await repo.open("req-6", "alice", "OptimStep")
    with pytest.raises(TypeError):
        await repo.complete("req-6", {"bad": object()})
    assert (await repo.get("req-6")).state is FutureState.PENDING, "an unencodable result changes nothing"


async def test_future_wait_is_woken_by_the_result_and_scoped_to_the_tenant(store: StateStore) -> None:
    repo = FutureRepository(store)
    await repo.open("req-7", "alice", "ForwardBackward")
    assert (await repo.wait("alice", "req-7", 0.01)).state is FutureState.PENDING
    waiter = asyncio.create_task(repo.wait("alice", "req-7", 30))
    await asyncio.sleep(0.02)
    await repo.complete("req-7", b"proto")
    done = await asyncio.wait_for(waiter, 5)
    assert done.result_bytes() == b"proto" and repo.pending_count() == 0
    assert await repo.wait("bob", "req-7", 0.01) is None
    assert await repo.wait("alice", "req-missing", 0.01) is None


async def test_pending_future_of_another_owner_fails_once_with_resubmit_hint(store: StateStore) -> None:
    await FutureRepository(store, owner="before-restart").open("req-8", "alice", "OptimStep")
    await FutureRepository(store, owner="before-restart").open("req-9", "alice", "OptimStep")
    restarted = FutureRepository(store, owner="after-restart")
    failed = await restarted.wait("alice", "req-8", 5)
    assert failed.state is FutureState.FAILED and failed.error.message == FutureRepository.RESTARTED
    assert (await restarted.wait("alice", "req-8", 5)).updated_at == failed.updated_at
    mine = FutureRepository(store, owner="before-restart")  # same owner, no local event: left alone
    assert (await mine.wait("alice", "req-9", 0.01)).state is FutureState.PENDING


async def test_running_future_of_another_owner_fails_with_resubmit_hint(store: StateStore) -> None:
    before = FutureRepository(store, owner="before-restart")
    await before.open("req-10", "alice", "ForwardBackward")
    await before.mark_running("req-10")  # the process died mid-step
    failed = await FutureRepository(store, owner="after-restart").wait("alice", "req-10", 5)
    assert failed.state is FutureState.FAILED and failed.error.message == FutureRepository.RESTARTED
    assert failed.error.category == "server"


def test_session_transitions_end_only_once() -> None:
    assert SESSION_TRANSITIONS[SessionState.ACTIVE] == {SessionState.FINISHED, SessionState.EXPIRED}
    for ended in (SessionState.FINISHED, SessionState.EXPIRED):
        for target in SessionState:
            with pytest.raises(IllegalTransition, match="session"):
                check_transition(SESSION_TRANSITIONS, ended, target)


async def test_session_ends_once_and_expiry_needs_silence(store: StateStore) -> None:
    clock = TickingClock()
    repo = SessionRepository(store, clock=clock)
    opened = await repo.open("s1", "alice", tags=["t"], user_metadata={"k": "v"})
    assert opened.active and opened.tags == ["t"]
    with pytest.raises(Exception, match="already exists"):
        await repo.open("s1", "bob", tags=[], user_metadata={})
    record, expired = await repo.expire_if_stale("s1", 30)
    assert not expired and record.active
    assert await repo.stale_sessions(30) == []
    clock.now += 60
    assert [s.session_id for s in await repo.stale_sessions(30)] == ["s1"]
    results = await asyncio.gather(*(repo.expire_if_stale("s1", 30) for _ in range(5)))
    assert [flag for _, flag in results].count(True) == 1, "exactly one caller ends it"
    record, ended = await repo.end("s1", SessionState.FINISHED, "success")
    assert not ended and record.state is SessionState.EXPIRED and record.finish_reason == "expired"
    assert await repo.stale_sessions(30) == []
    assert (await repo.end("missing", SessionState.FINISHED, None)) == (None, False)


def test_claim_ttl_covers_queue_execution_and_margin() -> None:
    assert claim_ttl_s(300, 1800) == 300 + 1800 + 60
    with pytest.raises(ValueError):
        claim_ttl_s(-1, 10)


async def test_dedup_claim_returns_the_original_request_id(store: StateStore) -> None:
    claims = DedupClaims(store)
    key = DedupClaims.seq_key("s1:train:0", 3)
    ttl = claim_ttl_s(10, 10)
    results = await asyncio.gather(*(claims.claim(key, f"req-{i}", ttl) for i in range(12)))
    winners = [f"req-{i}" for i, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert all(r == winners[0] for r in results if r is not None)
    assert await claims.claim(key, "req-retry", ttl) == winners[0]
    assert not await claims.release(key, "req-retry"), "only the holder may release"
    assert await claims.holder(key) == winners[0]
    assert await claims.release(key, winners[0])
    assert await claims.claim(key, "req-new", ttl) is None


async def test_dedup_claim_refuses_short_ttl_and_expires(store: StateStore, advance) -> None:
    claims = DedupClaims(store, min_ttl_s=0.1)
    with pytest.raises(ValueError, match="claim_ttl_s"):
        await claims.claim("k", "req-1", 0.05)
    assert await claims.claim("k", "req-1", 0.3) is None
    await advance(0.6)
    assert await claims.claim("k", "req-2", 0.3) is None
