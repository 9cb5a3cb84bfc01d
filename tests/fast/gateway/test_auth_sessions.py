"""API keys (files, env, constant-time lookup) and the session lifecycle (finish, expiry, 410)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.gateway.auth import ApiKeys, bearer_token, generate_api_key
from miles.gateway.errors import ApiError
from miles.gateway.sessions import Sessions, model_id_for, sampler_id_for
from miles.state import MemoryStateStore
from miles.state.records import SessionRepository, SessionState


def test_generated_keys_are_sdk_compatible_and_unique() -> None:
    keys = {generate_api_key() for _ in range(50)}
    assert len(keys) == 50 and all(k.startswith("tml-") and len(k) > 40 for k in keys)


def test_keys_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\ntml-aaaaaaaaaaaa alice\n\ntml-bbbbbbbbbbbb   # no tenant given\n")
    keys = ApiKeys.from_file(key_file)
    assert keys.tenant_for("tml-aaaaaaaaaaaa") == "alice"
    assert keys.tenant_for("tml-bbbbbbbbbbbb").startswith("tenant-")
    assert keys.tenant_for("tml-aaaaaaaaaaab") is None and keys.tenant_for(None) is None
    monkeypatch.setenv("MY_KEYS", "tml-cccccccccccc, tml-dddddddddddd")
    assert len(ApiKeys.from_env("MY_KEYS").tenants) == 2
    monkeypatch.setenv("MY_KEYS", "tml-cccccccccccc tml-dddddddddddd")  # whitespace separates keys too
    env_keys = ApiKeys.from_env("MY_KEYS")
    assert env_keys.tenant_for("tml-dddddddddddd") is not None
    assert env_keys.tenant_for("tml-cccccccccccc") != "tml-dddddddddddd"  # never a key as a tenant name
    key_file.write_text("tml-aaaaaaaaaaaa tml-bbbbbbbbbbbb\n")
    with pytest.raises(ValueError, match="looks like a second key"):
        ApiKeys.from_file(key_file)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sk-not-tinker-key", "must start with 'tml-'"),
        ("tml-a", "at least 12"),
        ("", "no API keys"),
        ("tml-aaaaaaaaaaaa bad/tenant", "tenant name"),
        ("tml-aaaaaaaaaaaa a b", "expected 'KEY' or 'KEY TENANT'"),
    ],
)
def test_bad_key_files_say_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ApiKeys.from_lines([text], source="keys")


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer tml-x") == "tml-x"
    assert bearer_token("bearer  tml-x ") == "tml-x"
    assert (
        bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer ") is None
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sessions(clock: Clock | None = None) -> tuple[Sessions, list[str]]:
    released: list[str] = []

    async def release(session_id: str) -> None:
        released.append(session_id)

    repo = SessionRepository(MemoryStateStore(), clock=clock or Clock())
    return Sessions(repo, timeout_s=30, release_models=release), released


async def test_session_expires_without_heartbeats_and_stays_gone() -> None:
    clock = Clock()
    sessions, released = _sessions(clock)
    sid = await sessions.create("t", tags=[], user_metadata={})
    clock.now += 25
    await sessions.heartbeat("t", sid)
    clock.now += 25  # 25 s after the last beat: still alive
    await sessions.heartbeat("t", sid)
    assert released == []
    clock.now += 31
    with pytest.raises(ApiError) as gone:
        await sessions.heartbeat("t", sid)
    assert gone.value.status == 410 and "expired" in gone.value.message
    assert released == [sid], "expiry releases the session's models"
    with pytest.raises(ApiError) as other:
        await sessions.heartbeat("u", sid)
    assert other.value.status == 404
    await sessions.finish("t", sid, "success")  # finishing an expired session changes nothing
    assert (await sessions.repo.get(sid)).state is SessionState.EXPIRED and released == [sid]


async def test_finished_session_refuses_heartbeats_and_new_models() -> None:
    sessions, released = _sessions()
    sid = await sessions.create("t", tags=["a"], user_metadata={"k": "v"})
    with pytest.raises(ApiError) as other:
        await sessions.finish("u", sid, "success")
    assert other.value.status == 404 and released == []
    await sessions.finish("t", sid, "success")
    await sessions.finish("t", sid, "again")
    assert released == [sid], "models are released once"
    for call in (sessions.heartbeat("t", sid), sessions.require_active("t", sid)):
        with pytest.raises(ApiError) as gone:
            await call
        assert gone.value.status == 410 and "finished" in gone.value.message
    record = await sessions.repo.get(sid)
    assert record.finish_reason == "success" and record.tags == ["a"]
    assert model_id_for(sid, 2) == f"{sid}:train:2" and sampler_id_for(sid, 0) == f"{sid}:sample:0"


async def test_sweep_expires_silent_sessions_only_once() -> None:
    clock = Clock()
    sessions, released = _sessions(clock)
    silent = await sessions.create("t", tags=[], user_metadata={})
    clock.now += 20
    alive = await sessions.create("t", tags=[], user_metadata={})
    done = await sessions.create("t", tags=[], user_metadata={})
    await sessions.finish("t", done, None)
    clock.now += 15
    assert await sessions.sweep() == [silent]
    assert await sessions.sweep() == []
    assert released == [done, silent]
    assert (await sessions.repo.get(alive)).state is SessionState.ACTIVE
