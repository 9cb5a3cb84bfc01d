"""Engine health checker: probes serving engines, and after `failure_threshold` consecutive failures hands
the engine to `on_failed` (the controller respawns it). Pausing stops probing only; a respawn already
running is not interrupted (the respawn itself pauses checks while it pushes weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthCheckConfig:
    interval_s: float = 30.0
    timeout_s: float = 30.0
    first_wait_s: float = 0.0
    failure_threshold: int = 3

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.first_wait_s < 0:
            raise ValueError("health check interval and timeout must be > 0 and first_wait >= 0 (seconds)")
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")


class HealthChecker:
    def __init__(
        self,
        config: HealthCheckConfig,
        *,
        targets: Callable[[], Sequence[Any]],
        probe: Callable[[Any], Awaitable[bool]],
        on_failed: Callable[[Any], Awaitable[None]],
    ) -> None:
        self.config = config
        self._targets = targets
        self._probe = probe
        self._on_failed = on_failed
        self._failures: dict[int, int] = {}
        self._handling: dict[int, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._paused = False

    @property
    def running(self) -> bool:
        """Started and not paused: what the weight-update bracket records and restores."""
        return self._task is not None and not self._task.done() and not self._paused

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-health-checker")
        self._paused = False

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._handling.values()) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _loop(self) -> None:
        await asyncio.sleep(self.config.first_wait_s)
        while True:
            if not self._paused:
                try:
                    await self.check_once()
                except Exception:  # a broken round must not end health checking for the job
                    logger.exception("engine health check round failed")
            await asyncio.sleep(self.config.interval_s)

    async def check_once(self) -> None:
        """Probe every target once, concurrently; count failures; hand over those past the threshold."""
        targets = [t for t in self._targets() if id(t) not in self._handling]
        results = await asyncio.gather(*(self._probe_bounded(t) for t in targets))
        for target, healthy in zip(targets, results, strict=True):
            key = id(target)
            self._failures[key] = 0 if healthy else self._failures.get(key, 0) + 1
            if self._failures[key] >= self.config.failure_threshold and not self._paused:
                self._failures[key] = 0
                logger.warning("%s failed %d health checks in a row", target, self.config.failure_threshold)
                self._handling[key] = asyncio.get_running_loop().create_task(self._handle(key, target))

    def hand_over(self, target: Any) -> None:
        """Handle `target`'s failure now (a request found its engine gone) rather than after
        `failure_threshold` probe rounds; not while paused (a weight update is running: the probes that
        follow it hand it over) nor twice."""
        key = id(target)
        if not self.running or key in self._handling:
            return
        self._failures[key] = 0
        logger.warning("%s failed a request and its health probe", target)
        self._handling[key] = asyncio.get_running_loop().create_task(self._handle(key, target))

    async def _probe_bounded(self, target: Any) -> bool:
        try:
            return bool(await asyncio.wait_for(self._probe(target), self.config.timeout_s))
        except Exception:
            return False

    async def _handle(self, key: int, target: Any) -> None:
        try:
            await self._on_failed(target)
        except Exception:
            logger.exception("handling the failure of %s failed", target)
        finally:
            self._handling.pop(key, None)

    async def wait_handled(self) -> None:
        """Wait until every failure handed over so far has been handled (tests, shutdown)."""
        while self._handling:
            await asyncio.gather(*self._handling.values(), return_exceptions=True)
