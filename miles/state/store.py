"""The StateStore contract: what the gateway must not lose, behind one small async interface.

Values are JSON-serialisable dicts, addressed by (namespace, key). Every implementation gives the same
guarantees, so code written against the memory store runs unchanged on Redis:

- `put_if_absent` is an atomic claim: of many concurrent callers exactly one gets True.
- `update` is an atomic read-modify-write: `fn` sees the current value (or None) and returns the new one
  (None deletes). `fn` may be called more than once (optimistic retries), so it must be pure; an exception
  raised by `fn` aborts the update and leaves the value untouched.
- `ttl_s` on `put`/`put_if_absent` sets an expiry (None: never expires). On `update`, None keeps the
  key's current expiry and a number replaces it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

JsonDict = dict[str, Any]
UpdateFn = Callable[[JsonDict | None], JsonDict | None]

# Namespaces name record kinds ("sessions", "futures"); keys are ids, which may contain ':' and '/'.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]+")


class StateStoreError(RuntimeError):
    """The state backend failed or refused an operation."""


class ConcurrencyError(StateStoreError):
    """An atomic update kept losing races and gave up after its bounded retries."""


@runtime_checkable
class StateStore(Protocol):
    async def get(self, ns: str, key: str) -> JsonDict | None: ...

    async def put(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> None: ...

    async def put_if_absent(
        self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None
    ) -> bool: ...

    async def delete(self, ns: str, key: str) -> bool: ...

    async def list(self, ns: str, prefix: str = "") -> list[tuple[str, JsonDict]]: ...

    async def update(
        self, ns: str, key: str, fn: UpdateFn, *, ttl_s: float | None = None
    ) -> JsonDict | None: ...

    async def close(self) -> None: ...


def check_address(ns: str, key: str) -> None:
    """Refuse namespaces/keys that would make keys ambiguous in a flat keyspace."""
    if not isinstance(ns, str) or not _NAMESPACE_RE.fullmatch(ns):
        raise ValueError(f"state namespace {ns!r} must match {_NAMESPACE_RE.pattern}")
    if not isinstance(key, str) or not key:
        raise ValueError(f"state key in namespace {ns!r} must be a non-empty string, got {key!r}")


def check_ttl(ttl_s: float | None) -> None:
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")


def encode_value(ns: str, key: str, value: Any) -> str:
    """Serialise a value, refusing anything that would not survive a round trip through Redis."""
    if not isinstance(value, dict):
        raise TypeError(f"state value for {ns}/{key} must be a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"state value for {ns}/{key} is not JSON-serialisable: {exc}") from exc


def decode_value(raw: str | bytes) -> JsonDict:
    return json.loads(raw)
