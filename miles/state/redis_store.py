"""StateStore on Redis (redis.asyncio), so a restarted gateway still knows its sessions, models and futures.

Key layout under `key_prefix`: `{prefix}:v:{ns}:{key}` holds a value as JSON text. Claims are SET NX PX,
updates are optimistic WATCH/MULTI/EXEC with bounded, jittered retries, listing is SCAN (never KEYS).
A client is bound to the event loop it is first used on.

Every call is bounded in time (`timeout_s`; the URL's `socket_timeout` if given, else 5 s), retries and
reconnects included: a Redis that is gone or paused costs a caller at most that long, then
`StateStoreUnavailable` (the gateway's 503). Socket timeouts bound one connect or read, not a call that
reconnects and retries; the deadline bounds the call. One immediate retry (not redis-py's default of 10
with backoff) for a connection that breaks under a command; an idle pooled connection that died with an
old server is replaced when taken from the pool, so the first call after Redis returns answers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    WatchError,
)

from miles.state.store import (
    ConcurrencyError,
    JsonDict,
    StateStoreError,
    StateStoreUnavailable,
    UpdateFn,
    check_address,
    check_ttl,
    decode_value,
    encode_value,
)

log = logging.getLogger(__name__)

_GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")
_MGET_BATCH = 500
DEFAULT_TIMEOUT_S = 5.0
# Replies that mean "this Redis cannot serve now" (loading, a replica after failover, full, disk
# refusing writes), not "this command is wrong".
_OUTAGE_REPLIES = ("MISCONF", "MASTERDOWN", "BUSY ", "TRYAGAIN")


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


def _url_timeout_s(url: str) -> float | None:
    """The URL's `socket_timeout` query option (redis-py's own name for it), if it has one."""
    values = parse_qs(urlsplit(url).query).get("socket_timeout")
    if not values:
        return None
    try:
        return float(values[-1])
    except ValueError:
        raise ValueError(
            f"socket_timeout={values[-1]!r} in the Redis URL is not a number of seconds"
        ) from None


def is_outage(exc: RedisError) -> bool:
    """True when `exc` says Redis is unreachable or cannot serve now, rather than that a command (or the
    configured password) is wrong."""
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return False
    if isinstance(
        exc, redis_errors.ConnectionError | redis_errors.TimeoutError | ReadOnlyError | OutOfMemoryError
    ):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_OUTAGE_REPLIES)


class RedisStateStore:
    def __init__(
        self,
        url: str,
        key_prefix: str = "miles",
        *,
        max_update_retries: int = 100,
        timeout_s: float | None = None,
    ) -> None:
        if not key_prefix:
            raise ValueError("key_prefix must be non-empty so stores sharing a Redis stay apart")
        if max_update_retries < 1:
            raise ValueError(f"max_update_retries must be >= 1, got {max_update_retries}")
        if timeout_s is None:
            timeout_s = _url_timeout_s(url) or DEFAULT_TIMEOUT_S
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self._url = _redact(url)
        self._prefix = key_prefix
        self._max_update_retries = max_update_retries
        self.timeout_s = timeout_s
        self._outage_since: float | None = None  # monotonic time of the first failure of an outage
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )

    def _value_key(self, ns: str, key: str) -> str:
        return f"{self._prefix}:v:{ns}:{key}"

    @asynccontextmanager
    async def _call(self, what: str) -> AsyncIterator[None]:
        """Bound the call to `timeout_s` and turn Redis's errors into the store's."""
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except TimeoutError as exc:  # our own bound: Redis is paused, hung or the network is dropping
            self._outage(f"did not answer within {self.timeout_s:g} s ({what})", exc)
        except WatchError:
            raise
        except RedisError as exc:
            if is_outage(exc):
                self._outage(f"is unreachable ({what}): {exc}", exc)
            raise StateStoreError(f"Redis state store at {self._url} failed to {what}: {exc}") from exc
        except OSError as exc:
            self._outage(f"is unreachable ({what}): {exc}", exc)
        self._recovered()

    def _outage(self, problem: str, cause: BaseException) -> None:
        message = f"Redis state store at {self._url} {problem}"
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("state store unavailable: %s", message)
        raise StateStoreUnavailable(message) from cause

    def _recovered(self) -> None:
        if self._outage_since is not None:
            down_s = time.monotonic() - self._outage_since
            log.warning("state store at %s answers again after %.1f s", self._url, down_s)
            self._outage_since = None

    async def get(self, ns: str, key: str) -> JsonDict | None:
        check_address(ns, key)
        async with self._call(f"get {ns}/{key}"):
            raw = await self._redis.get(self._value_key(ns, key))
        return None if raw is None else decode_value(raw)

    async def put(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> None:
        check_address(ns, key)
        check_ttl(ttl_s)
        raw = encode_value(ns, key, value)
        async with self._call(f"put {ns}/{key}"):
            await self._redis.set(self._value_key(ns, key), raw, px=_px(ttl_s))

    async def put_if_absent(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> bool:
        check_address(ns, key)
        check_ttl(ttl_s)
        raw = encode_value(ns, key, value)
        async with self._call(f"claim {ns}/{key}"):
            return bool(await self._redis.set(self._value_key(ns, key), raw, px=_px(ttl_s), nx=True))

    async def delete(self, ns: str, key: str) -> bool:
        check_address(ns, key)
        async with self._call(f"delete {ns}/{key}"):
            return bool(await self._redis.delete(self._value_key(ns, key)))

    async def _scan(self, match: str) -> list[str]:
        return [key async for key in self._redis.scan_iter(match=match, count=500)]

    async def list(self, ns: str, prefix: str = "") -> list[tuple[str, JsonDict]]:
        check_address(ns, "-")
        head = self._value_key(ns, "")
        async with self._call(f"list {ns}/{prefix}*"):
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
        async with self._call(f"update {ns}/{key}"), self._redis.pipeline(transaction=True) as pipe:
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
        async with self._call(f"purge prefix {self._prefix}"):
            keys = await self._scan(_glob_escape(f"{self._prefix}:") + "*")
            for start in range(0, len(keys), _MGET_BATCH):
                await self._redis.delete(*keys[start : start + _MGET_BATCH])

    async def ping(self) -> None:
        async with self._call("answer PING"):
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
