"""The StateStore contract, run against every implementation (memory and a real Redis)."""

from __future__ import annotations

import asyncio

import pytest

from miles.state import StateStore


async def test_get_put_roundtrip_returns_copies(store: StateStore) -> None:
    assert await store.get("things", "a") is None
    value = {"n": 1, "nested": {"xs": [1, 2.5, "s", None, True]}}
    await store.put("things", "a", value)
    got = await store.get("things", "a")
    assert got == value
    got["n"] = 99  # mutating what we got must not change what is stored
    assert (await store.get("things", "a"))["n"] == 1
    await store.put("things", "a", {"n": 2})
    assert await store.get("things", "a") == {"n": 2}


async def test_namespaces_are_separate(store: StateStore) -> None:
    await store.put("ns1", "k", {"v": 1})
    await store.put("ns2", "k", {"v": 2})
    assert await store.get("ns1", "k") == {"v": 1}
    assert await store.get("ns2", "k") == {"v": 2}
    assert await store.list("ns1") == [("k", {"v": 1})]


async def test_keys_with_ids_characters_and_glob_metacharacters(store: StateStore) -> None:
    keys = ["sess-1:train:0", "a/b/c", "star*key", "q?[x]\\y"]
    for i, key in enumerate(keys):
        await store.put("ids", key, {"i": i})
    for i, key in enumerate(keys):
        assert await store.get("ids", key) == {"i": i}
    assert [k for k, _ in await store.list("ids", "star*")] == ["star*key"]
    assert [k for k, _ in await store.list("ids", "q?[")] == ["q?[x]\\y"]


async def test_refuses_values_that_are_not_json_dicts(store: StateStore) -> None:
    with pytest.raises(TypeError, match="dict"):
        await store.put("things", "a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON"):
        await store.put("things", "a", {"b": b"bytes"})
    with pytest.raises(ValueError, match="namespace"):
        await store.put("bad:ns", "a", {})
    with pytest.raises(ValueError, match="ttl_s"):
        await store.put("things", "a", {}, ttl_s=0)
    assert await store.get("things", "a") is None


async def test_delete_reports_presence(store: StateStore) -> None:
    await store.put("things", "a", {"v": 1})
    assert await store.delete("things", "a") is True
    assert await store.delete("things", "a") is False
    assert await store.get("things", "a") is None


async def test_ttl_expiry(store: StateStore, advance) -> None:
    await store.put("ttl", "short", {"v": 1}, ttl_s=0.3)
    await store.put("ttl", "forever", {"v": 2})
    assert await store.get("ttl", "short") == {"v": 1}
    await advance(0.6)
    assert await store.get("ttl", "short") is None
    assert await store.get("ttl", "forever") == {"v": 2}
    assert [k for k, _ in await store.list("ttl")] == ["forever"]
    # an expired key can be claimed again
    assert await store.put_if_absent("ttl", "short", {"v": 3}, ttl_s=10)


async def test_put_without_ttl_clears_expiry_and_update_keeps_it(store: StateStore, advance) -> None:
    await store.put("ttl", "a", {"v": 1}, ttl_s=0.3)
    await store.put("ttl", "a", {"v": 2})  # plain put: no expiry any more
    await store.put("ttl", "b", {"v": 1}, ttl_s=0.3)
    await store.update("ttl", "b", lambda cur: {"v": cur["v"] + 1})  # keeps b's expiry
    await store.update("ttl", "c", lambda cur: {"v": 0}, ttl_s=0.3)  # sets one
    await advance(0.6)
    assert await store.get("ttl", "a") == {"v": 2}
    assert await store.get("ttl", "b") is None
    assert await store.get("ttl", "c") is None


async def test_put_if_absent_race_has_exactly_one_winner(store: StateStore) -> None:
    async def contender(i: int) -> bool:
        await asyncio.sleep(0)
        return await store.put_if_absent("claims", "the-key", {"winner": i}, ttl_s=30)

    results = await asyncio.gather(*(contender(i) for i in range(40)))
    assert sum(results) == 1
    winner = results.index(True)
    assert await store.get("claims", "the-key") == {"winner": winner}


async def test_update_is_atomic_under_concurrency(store: StateStore) -> None:
    def add_one(current: dict | None) -> dict:
        current = current or {"count": 0, "seen": []}
        return {"count": current["count"] + 1, "seen": current["seen"]}

    await asyncio.gather(*(store.update("counters", "c", add_one) for _ in range(30)))
    assert (await store.get("counters", "c"))["count"] == 30


async def test_update_none_deletes_and_raising_fn_leaves_value(store: StateStore) -> None:
    await store.put("things", "a", {"v": 1})

    def boom(current: dict | None) -> dict:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await store.update("things", "a", boom)
    assert await store.get("things", "a") == {"v": 1}
    assert await store.update("things", "a", lambda cur: None) is None
    assert await store.get("things", "a") is None
    assert await store.update("things", "missing", lambda cur: None) is None


async def test_update_returns_new_value(store: StateStore) -> None:
    new = await store.update("things", "a", lambda cur: {"v": 1 if cur is None else cur["v"] + 1})
    assert new == {"v": 1}
    new = await store.update("things", "a", lambda cur: {"v": 1 if cur is None else cur["v"] + 1})
    assert new == {"v": 2}


async def test_list_by_prefix_sorted(store: StateStore) -> None:
    for key in ["b:2", "a:1", "b:10", "b:1", "c"]:
        await store.put("items", key, {"k": key})
    assert [k for k, _ in await store.list("items")] == ["a:1", "b:1", "b:10", "b:2", "c"]
    listed = await store.list("items", "b:")
    assert listed == [("b:1", {"k": "b:1"}), ("b:10", {"k": "b:10"}), ("b:2", {"k": "b:2"})]
    assert await store.list("items", "zzz") == []
    assert await store.list("empty-ns") == []
