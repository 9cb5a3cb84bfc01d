"""Checkpoints committed behind their save's answer: the runtime took the snapshot (a host copy of the
weights, miles.train.write_behind) and writes its files while the job goes on; the manager commits the
checkpoint once they are whole.

Until then the checkpoint is pending here, in this gateway process. A lookup that needs its files (a
download, a listing, a delete, a TTL change) waits for the commit; one that only names the snapshot
(sampling from it: the engines were given its weights by the push) does not. A write that fails leaves no
checkpoint and its failure: a lookup of that path then says what happened instead of "not found".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from miles.checkpoints.paths import CheckpointNotFound, TinkerPath
from miles.contract import events
from miles.state.records import CheckpointRecord

log = logging.getLogger(__name__)

KEPT_FAILURES = 256  # failed writes remembered for their lookups (the oldest go first)


@dataclass
class PendingWrite:
    provisional: CheckpointRecord  # the record it will have, but for its size (unknown before the files)
    task: asyncio.Task[Any]
    answered: float  # time.monotonic() when its save answered

    @property
    def tenant(self) -> str:
        return self.provisional.tenant


class PendingWrites:
    def __init__(self) -> None:
        self._pending: dict[str, PendingWrite] = {}
        self._failed: OrderedDict[str, tuple[str, str]] = OrderedDict()  # index key -> (tenant, why)

    def add(self, address: TinkerPath, provisional: CheckpointRecord, commit: Awaitable[Any]) -> None:
        """`commit` waits for the files, then commits the checkpoint (or aborts the save and raises)."""
        self.forget_failure(address)
        task = asyncio.ensure_future(commit)
        self._pending[address.index_key] = PendingWrite(provisional, task, time.monotonic())
        task.add_done_callback(lambda done: self._settled(address, provisional.tenant, done))

    def _settled(self, address: TinkerPath, tenant: str, task: asyncio.Task[Any]) -> None:
        key = address.index_key
        pending = self._pending.pop(key, None)
        seconds = round(time.monotonic() - pending.answered, 3) if pending is not None else None
        if task.cancelled():
            why = "the gateway stopped before the files were written"
        elif (exc := task.exception()) is None:
            log.info("%s committed %s s after its save answered", address.uri, seconds)
            events.record("checkpoint_behind", path=address.uri, seconds=seconds)
            return
        else:
            why = f"{type(exc).__name__}: {exc}"
        log.error("the files of checkpoint %s were not written behind its save: %s", address.uri, why)
        events.record("checkpoint_behind", path=address.uri, seconds=seconds, error=why)
        self._failed[key] = (tenant, why)
        while len(self._failed) > KEPT_FAILURES:
            self._failed.popitem(last=False)

    def forget_failure(self, address: TinkerPath) -> None:
        """A new save of the address: an earlier failed write no longer speaks for it."""
        self._failed.pop(address.index_key, None)

    def pending(self, address: TinkerPath) -> PendingWrite | None:
        return self._pending.get(address.index_key)

    async def settle(self, address: TinkerPath, tenant: str | None) -> None:
        """Until the write of `address` (if one is pending) is committed; CheckpointNotFound saying why
        if it failed, now or before. `tenant`: the caller, who must own a pending checkpoint to wait for it
        (not yet committed, it cannot be published); None: a caller who proved access another way."""
        pending = self._pending.get(address.index_key)
        if pending is not None and tenant is not None and pending.tenant != tenant:
            raise CheckpointNotFound(f"no checkpoint {address.uri}")
        if pending is not None:  # its outcome, not its exception: a caller cancelled still is
            await asyncio.wait([pending.task])
        failed = self._failed.get(address.index_key)
        if failed is not None and tenant in (None, failed[0]):
            why = failed[1]
            raise CheckpointNotFound(
                f"{address.uri} was not kept: its files could not be written after the save answered "
                f"({why}); save it again"
            )

    async def settle_all(self) -> None:
        """Until every write pending now is done (committed or failed)."""
        tasks = [p.task for p in self._pending.values()]
        if tasks:
            await asyncio.wait(tasks)

    async def drain(self, timeout_s: float) -> int:
        """At shutdown: wait for the pending writes, at most `timeout_s`; cancel the rest (their saves are
        aborted). How many were cancelled."""
        tasks = [p.task for p in self._pending.values()]
        if not tasks:
            return 0
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
        return len(late)
