"""The StateStore contract: what the gateway must not lose, behind one small async interface.

Values are JSON-serialisable dicts, addressed by (namespace, key). Every implementation gives the same
guarantees, so code written against the memory store runs unchanged on Redis:

- `put_if_absent` is an atomic claim: of many concurrent callers exactly one gets True.
- `update` is an atomic read-modify-write: `fn` sees the current value (or None) and returns the new one
  (None deletes). `fn` may be called more than once (optimistic retries), so it must be pure; an exception
  raised by `fn` aborts the update and leaves the value untouched.
- `ttl_s` on `put`/`put_if_absent` sets an expiry (None: never expires). On `update`, None keeps the
  key's current expiry and a number replaces it.
- A backend that cannot be reached, or does not answer within its time bound, raises
  `StateStoreUnavailable` (the gateway answers 503); no call waits longer than that bound.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from miles.errors import Category, MilesError

JsonDict = dict[str, Any]
UpdateFn = Callable[[JsonDict | None], JsonDict | None]

# Namespaces name record kinds ("sessions", "futures"); keys are ids, which may contain ':' and '/'.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]+")


class StateStoreError(MilesError, RuntimeError):
    """The state backend failed or refused an operation."""


class ConcurrencyError(StateStoreError):
    """An atomic update kept losing races and gave up after its bounded retries."""


class StateStoreUnavailable(StateStoreError):
    """The backend is unreachable or did not answer in time: nobody's fault, try again shortly.

    `str()` keeps the detail (address, operation, cause) for the log; clients are told only what happened,
    not where the store lives or which keys were being read.
    """

    category = Category.UNAVAILABLE
    kind = "state_store_unavailable"  # the error body's `type`

    def public_message(self) -> str:
        return (
            "the gateway's state store is unavailable (unreachable or not answering); retry in a few seconds"
        )


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

    async def ping(self) -> None:
        """Return once the backend answers; raise StateStoreUnavailable when it does not."""
        ...

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
