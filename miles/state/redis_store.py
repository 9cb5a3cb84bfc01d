"""StateStore on Redis (redis.asyncio), so a restarted gateway still knows its sessions, models and futures.

Key layout under `key_prefix`: `{prefix}:v:{ns}:{key}` holds a value as JSON text. Claims are SET NX PX,
updates are optimistic WATCH/MULTI/EXEC with bounded, jittered retries, listing is SCAN (never KEYS).
A client is bound to the event loop it is first used on.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from miles.state.store import (
    ConcurrencyError,
    JsonDict,
    StateStoreError,
    UpdateFn,
    check_address,
    check_ttl,
    decode_value,
    encode_value,
)

_GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")
_MGET_BATCH = 500


def _glob_escape(text: str) -> str:
    return _GLOB_SPECIALS.sub(r"\\\1", text)


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


def _px(ttl_s: float | None) -> int | None:
    return None if ttl_s is None else max(1, round(ttl_s * 1000))


class RedisStateStore:
    def __init__(
        self,
        url: str,
        key_prefix: str = "miles",
        *,
        max_update_retries: int = 100,
        socket_timeout_s: float = 10.0,
    ) -> None:
        if not key_prefix:
            raise ValueError("key_prefix must be non-empty so stores sharing a Redis stay apart")
        if max_update_retries < 1:
            raise ValueError(f"max_update_retries must be >= 1, got {max_update_retries}")
        self._url = _redact(url)
        self._prefix = key_prefix
        self._max_update_retries = max_update_retries
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
        )

    def _value_key(self, ns: str, key: str) -> str:
        return f"{self._prefix}:v:{ns}:{key}"

    @contextmanager
    def _translated_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except WatchError:
            raise
        except RedisError as exc:
            raise StateStoreError(f"Redis state store at {self._url} failed to {what}: {exc}") from exc

    async def get(self, ns: str, key: str) -> JsonDict | None:
        check_address(ns, key)
        with self._translated_errors(f"get {ns}/{key}"):
            raw = await self._redis.get(self._value_key(ns, key))
        return None if raw is None else decode_value(raw)

    async def put(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> None:
        check_address(ns, key)
        check_ttl(ttl_s)
        raw = encode_value(ns, key, value)
        with self._translated_errors(f"put {ns}/{key}"):
            await self._redis.set(self._value_key(ns, key), raw, px=_px(ttl_s))

    async def put_if_absent(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> bool:
        check_address(ns, key)
        check_ttl(ttl_s)
        raw = encode_value(ns, key, value)
        with self._translated_errors(f"claim {ns}/{key}"):
            return bool(await self._redis.set(self._value_key(ns, key), raw, px=_px(ttl_s), nx=True))

    async def delete(self, ns: str, key: str) -> bool:
        check_address(ns, key)
        with self._translated_errors(f"delete {ns}/{key}"):
            return bool(await self._redis.delete(self._value_key(ns, key)))

    async def _scan(self, match: str) -> list[str]:
        return [key async for key in self._redis.scan_iter(match=match, count=500)]

    async def list(self, ns: str, prefix: str = "") -> list[tuple[str, JsonDict]]:
        check_address(ns, "-")
        head = self._value_key(ns, "")
        with self._translated_errors(f"list {ns}/{prefix}*"):
            keys = sorted(await self._scan(_glob_escape(head + prefix) + "*"))
            out: list[tuple[str, JsonDict]] = []
            for start in range(0, len(keys), _MGET_BATCH):
                batch = keys[start : start + _MGET_BATCH]
                for rkey, raw in zip(batch, await self._redis.mget(batch), strict=True):
                    if raw is not None:  # expired between SCAN and MGET
                        out.append((rkey[len(head) :], decode_value(raw)))
        return out

    async def update(self, ns: str, key: str, fn: UpdateFn, *, ttl_s: float | None = None) -> JsonDict | None:
        check_address(ns, key)
        check_ttl(ttl_s)
        rkey = self._value_key(ns, key)
        with self._translated_errors(f"update {ns}/{key}"):
            async with self._redis.pipeline(transaction=True) as pipe:
                for attempt in range(self._max_update_retries):
                    try:
                        return await self._try_update(pipe, ns, key, rkey, fn, ttl_s)
                    except WatchError:
                        await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
        raise ConcurrencyError(
            f"update of {ns}/{key} lost {self._max_update_retries} races in a row to concurrent writers; "
            "retry the request, or reduce contention on this key"
        )

    async def _try_update(
        self, pipe: aioredis.client.Pipeline, ns: str, key: str, rkey: str, fn: UpdateFn, ttl_s: float | None
    ) -> JsonDict | None:
        await pipe.watch(rkey)
        raw = await pipe.get(rkey)
        new = fn(None if raw is None else decode_value(raw))
        encoded = None if new is None else encode_value(ns, key, new)
        pipe.multi()
        if encoded is None:
            pipe.delete(rkey)
        elif ttl_s is None:
            pipe.set(rkey, encoded, keepttl=True)
        else:
            pipe.set(rkey, encoded, px=_px(ttl_s))
        await pipe.execute()
        return None if encoded is None else decode_value(encoded)

    async def purge(self) -> None:
        """Delete every key under this store's prefix (tests, resets); other prefixes are untouched."""
        with self._translated_errors(f"purge prefix {self._prefix}"):
            keys = await self._scan(_glob_escape(f"{self._prefix}:") + "*")
            for start in range(0, len(keys), _MGET_BATCH):
                await self._redis.delete(*keys[start : start + _MGET_BATCH])

    async def ping(self) -> None:
        with self._translated_errors("answer PING"):
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
