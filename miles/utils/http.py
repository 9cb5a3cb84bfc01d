"""The one factory for httpx clients in the runtime.

Every HTTP call the runtime makes (to engines, to the gateway, to routers) goes through a client built here,
so pooling, timeouts and keep-alive are decided in one place:

- One `httpx.AsyncClient` per running event loop and purpose. httpx clients are bound to the loop that first
  used them; sharing one across loops (Ray actors, threads running their own loops) breaks in odd ways.
- Keep-alive expiry `KEEPALIVE_EXPIRY_S` = 2 s. SGLang's uvicorn closes a connection idle for
  `SGLANG_TIMEOUT_KEEP_ALIVE` seconds (default 5). A client that keeps idle connections longer (httpx's own
  default is exactly 5 s) may send a request on a socket the server closes at the same moment: the request
  meets a TCP reset (ReadError / RemoteProtocolError). Expiring our idle connections well before any
  server's keep-alive means a pooled connection is never reused after the server may have closed it.
- Explicit connect/read/write/pool timeouts and explicit pool limits: no implicit 100-connection cliff.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

import httpx

KEEPALIVE_EXPIRY_S = 2.0
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ClientProfile:
    """Timeouts (seconds; None = no limit) and pool limits of one kind of client."""

    connect_s: float
    read_s: float | None
    write_s: float
    pool_s: float
    max_connections: int
    max_keepalive_connections: int

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_s, read=self.read_s, write=self.write_s, pool=self.pool_s)

    def limits(self) -> httpx.Limits:
        return httpx.Limits(
            max_connections=self.max_connections,
            max_keepalive_connections=self.max_keepalive_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )


# "engine": generation and weight updates can legitimately take minutes (a weight-group rendezvous waits for
# every peer), so the read timeout is long; a caller that needs a tighter bound passes a per-request timeout.
# 512 connections: a gateway fanning many concurrent samples out to a few engines must not queue at the pool.
PROFILES: dict[str, ClientProfile] = {
    "engine": ClientProfile(CONNECT_TIMEOUT_S, 1800.0, 120.0, 120.0, 512, 128),
    "probe": ClientProfile(5.0, 30.0, 10.0, 10.0, 64, 16),
    "gateway": ClientProfile(CONNECT_TIMEOUT_S, 120.0, 60.0, 60.0, 256, 64),
}

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, httpx.AsyncClient]] = (
    weakref.WeakKeyDictionary()
)


def build_async_client(profile: ClientProfile, **overrides: object) -> httpx.AsyncClient:
    """A new, uncached client with `profile`'s settings (tools and tests that need their own pool)."""
    # trust_env=False: an http_proxy exported on HPC nodes (for hub downloads) must never carry our calls
    # to engines and gateways on node IPs; a proxy's 503 would look like a dead engine or trainer.
    kwargs: dict[str, object] = {
        "timeout": profile.timeout(),
        "limits": profile.limits(),
        "trust_env": False,
    }
    kwargs.update(overrides)
    return httpx.AsyncClient(**kwargs)  # type: ignore[arg-type]


def get_async_client(*, purpose: str = "engine") -> httpx.AsyncClient:
    """The shared client of the running event loop for `purpose` (one of `PROFILES`).

    Must be called from inside a running loop; the client lives until `close_clients()` or the loop is gone.
    """
    if purpose not in PROFILES:
        raise ValueError(f"unknown HTTP client purpose {purpose!r}; use one of {sorted(PROFILES)}")
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    client = per_loop.get(purpose)
    if client is None or client.is_closed:
        client = build_async_client(PROFILES[purpose])
        per_loop[purpose] = client
    return client


async def close_clients() -> None:
    """Close the running loop's clients (call at shutdown, from the loop that used them)."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.pop(loop, {})
    for client in per_loop.values():
        await client.aclose()
