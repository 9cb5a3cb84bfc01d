"""CheckpointManager: the only code that creates, finds and deletes checkpoint directories.

Layout: `root/<model_id>/<kind>/<name>/` with a `metadata.json` that names the checkpoint (tinker path,
tenant, ...). A save writes into `root/.staging/<uuid>/` and `commit` moves it into place with one rename,
so a checkpoint is either absent or complete, and a committed sampler snapshot is never rewritten.

Safety rule for every lookup and delete: a directory counts as a checkpoint only if it sits exactly at the
path its address names (no symlink anywhere below root), and its metadata.json names that checkpoint and
the caller as owner. Anything else is CheckpointNotFound and nothing on disk is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.checkpoints.behind import PendingWrites
from miles.checkpoints.paths import (
    CHECKPOINT_KINDS,
    TINKER_SCHEME,
    CheckpointExists,
    CheckpointKind,
    CheckpointNotFound,
    TinkerPath,
    checked_new_path,
    is_valid_model_id,
    parse_checkpoint_id,
    parse_tinker_path,
)
from miles.errors import UserError
from miles.state.records import CheckpointRecord, ModelRecord, ModelRepository
from miles.state.store import StateStore

CheckpointInfo = CheckpointRecord
METADATA_FILE = "metadata.json"
INDEX_NS = "checkpoints"
WRITE_CLAIMS_NS = "checkpoint-writes"
# Caller-supplied metadata keys commit() accepts; the rest of the record is the manager's own.
COMMIT_METADATA_KEYS = frozenset({"has_optimizer", "base_model", "is_lora", "lora_rank", "user_metadata"})


@dataclass(frozen=True)
class CheckpointHandle:
    """A save in progress: write the checkpoint's files into `path`, then commit or abort."""

    address: TinkerPath
    tenant: str
    path: Path  # staging directory to write into
    final_path: Path  # where commit() puts it
    overwrite: bool
    ttl_seconds: float | None

    @property
    def tinker_path(self) -> str:
        return self.address.uri


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class CheckpointManager:
    def __init__(
        self,
        root: Path,
        store: StateStore,
        *,
        clock: Callable[[], float] = time.time,
        write_claim_ttl_s: float = 24 * 3600.0,
    ) -> None:
        self.root = Path(root).resolve()
        for scratch in (".staging", ".trash"):
            (self.root / scratch).mkdir(parents=True, exist_ok=True)
        self.store = store
        self.clock = clock
        self.write_claim_ttl_s = write_claim_ttl_s
        self._models = ModelRepository(store, clock=clock)
        self._pins: Counter[str] = Counter()  # tinker paths being read now (loads, samples)
        self._behind = PendingWrites()  # saves answered before their files were written (behind.py)

    parse_tinker_path = staticmethod(parse_tinker_path)

    def _dir_of(self, address: TinkerPath) -> Path:
        return self.root / address.model_id / address.kind / address.name

    def _scratch(self, purpose: str) -> Path:
        return self.root / f".{purpose}" / uuid.uuid4().hex

    # ---- saving -------------------------------------------------------------------------------------

    async def allocate(
        self,
        tenant: str,
        model_id: str,
        kind: CheckpointKind,
        name: str | None = None,
        *,
        overwrite: bool = False,
        ttl_seconds: float | None = None,
    ) -> CheckpointHandle:
        """Reserve `tinker://model_id/kind/name` for one save. Unnamed saves get a fresh unique name.

        Refuses (CheckpointExists) a committed name unless `overwrite` and kind is `weights`: sampler
        snapshots are immutable. Two concurrent saves of one name: the second is refused.
        """
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise UserError(f"ttl_seconds must be a positive number of seconds, got {ttl_seconds!r}")
        name = name if name is not None else time.strftime("%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:8]
        address = checked_new_path(model_id, kind, name)
        staging = self._scratch("staging")
        claim = {"tenant": tenant, "staging": staging.name}
        if not await self.store.put_if_absent(
            WRITE_CLAIMS_NS, address.index_key, claim, ttl_s=self.write_claim_ttl_s
        ):
            raise CheckpointExists(f"{address.uri} is being written by another save; use another name")
        try:
            self._check_replaceable(address, tenant, overwrite)
            staging.mkdir()
        except BaseException:
            await self.store.delete(WRITE_CLAIMS_NS, address.index_key)
            raise
        return CheckpointHandle(address, tenant, staging, self._dir_of(address), overwrite, ttl_seconds)

    def _check_replaceable(self, address: TinkerPath, tenant: str, overwrite: bool) -> None:
        final = self._dir_of(address)
        if not os.path.lexists(final):
            return
        if address.kind == "sampler_weights":
            raise CheckpointExists(
                f"{address.uri} exists and sampler snapshots are immutable; use another name"
            )
        if not overwrite:
            raise CheckpointExists(f"{address.uri} exists; use another name or save with overwrite=true")
        try:
            self._verified_dir(address, tenant)
        except CheckpointNotFound:
            raise CheckpointExists(f"{address.uri} exists and cannot be replaced; use another name") from None

    def upload_area(self, upload_id: str) -> Path:
        """A new directory for an external weights upload's files (`.uploads/<id>`): on the checkpoint
        filesystem, so that finishing the upload moves them into the checkpoint and never copies."""
        path = self.root / ".uploads" / upload_id
        path.mkdir(parents=True)
        return path

    async def commit_files(
        self,
        tenant: str,
        model_id: str,
        kind: CheckpointKind,
        name: str,
        source: Path,
        metadata: dict[str, Any],
    ) -> CheckpointInfo:
        """A checkpoint made of the files in `source`, moved into it (source is left empty)."""
        handle = await self.allocate(tenant, model_id, kind, name)
        try:
            for file in source.iterdir():
                os.rename(file, handle.path / file.name)
        except BaseException:
            await self.abort(handle)
            raise
        return await self.commit(handle, metadata)

    async def commit(self, handle: CheckpointHandle, metadata: dict[str, Any]) -> CheckpointInfo:
        """Write metadata.json, move the staged files into place, index the checkpoint.

        Any failure aborts the save (staged files removed, name released) and re-raises.
        """
        try:
            record = await self._record_for(handle, metadata)
            (handle.path / METADATA_FILE).write_text(record.model_dump_json(indent=2))
            await asyncio.to_thread(self._move_into_place, handle)
            await self.store.put(INDEX_NS, handle.address.index_key, record.model_dump(mode="json"))
            await self._models.modify(record.model_id, lambda m: _with_latest(m, record))
        except BaseException:
            await self.abort(handle)
            raise
        await self.store.delete(WRITE_CLAIMS_NS, handle.address.index_key)
        self._behind.forget_failure(handle.address)
        return record

    async def _record_for(self, handle: CheckpointHandle, metadata: dict[str, Any]) -> CheckpointRecord:
        return self._record(handle, metadata, await asyncio.to_thread(_dir_size, handle.path))

    def _record(self, handle: CheckpointHandle, metadata: dict[str, Any], size: int) -> CheckpointRecord:
        unknown = set(metadata) - COMMIT_METADATA_KEYS
        if unknown:
            allowed = sorted(COMMIT_METADATA_KEYS)
            raise ValueError(f"unknown checkpoint metadata keys {sorted(unknown)}; allowed: {allowed}")
        now = self.clock()
        return CheckpointRecord(
            tinker_path=handle.tinker_path,
            tenant=handle.tenant,
            model_id=handle.address.model_id,
            kind=handle.address.kind,
            name=handle.address.name,
            created_at=now,
            size_bytes=size,
            ttl_seconds=handle.ttl_seconds,
            expires_at=None if handle.ttl_seconds is None else now + handle.ttl_seconds,
            **metadata,
        )

    def commit_behind(
        self, handle: CheckpointHandle, metadata: dict[str, Any], written: Awaitable[None]
    ) -> CheckpointInfo:
        """Commit once `written` completes (the runtime writes the files behind the save's answer); abort if
        it raises. Until then the checkpoint is pending (behind.py). Its provisional record (size 0)."""

        async def commit() -> CheckpointInfo:
            try:
                await written
            except BaseException:
                await self.abort(handle)
                raise
            return await self.commit(handle, metadata)

        provisional = self._record(handle, metadata, 0)
        self._behind.add(handle.address, provisional, commit())
        return provisional

    async def drain(self, timeout_s: float) -> int:
        """At shutdown: the checkpoints still being written behind get `timeout_s` to be committed; the
        rest are aborted. How many were."""
        return await self._behind.drain(timeout_s)

    async def copy(
        self,
        source_dir: Path,
        source: CheckpointInfo,
        tenant: str,
        model_id: str,
        *,
        ttl_seconds: float | None,
    ) -> CheckpointInfo:
        """Commit `source` (a located checkpoint) again as `tinker://model_id/<its kind>/<its name>`, owned by
        `tenant`: its files hard-linked (copied where the filesystem cannot link), so no bytes are
        duplicated and deleting either leaves the other whole. Not published; the source's TTL is not kept."""
        handle = await self.allocate(tenant, model_id, source.kind, source.name, ttl_seconds=ttl_seconds)
        try:
            await asyncio.to_thread(_link_files, self.files_of(source_dir), handle.path)
        except BaseException:
            await self.abort(handle)
            raise
        metadata = {key: getattr(source, key) for key in COMMIT_METADATA_KEYS}
        return await self.commit(handle, metadata)

    def _move_into_place(self, handle: CheckpointHandle) -> None:
        final = handle.final_path
        final.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(final):
            # rename() would silently replace an empty directory: mkdir first makes "exists" an error
            final.mkdir()
            os.rename(handle.path, final)
            return
        self._check_replaceable(handle.address, handle.tenant, handle.overwrite)
        trash = self._scratch("trash")
        os.rename(final, trash)
        os.rename(handle.path, final)
        shutil.rmtree(trash)

    async def abort(self, handle: CheckpointHandle) -> None:
        """Drop a save that will not be committed: its staged files and its name reservation."""
        await asyncio.to_thread(shutil.rmtree, handle.path, True)
        await self.store.delete(WRITE_CLAIMS_NS, handle.address.index_key)

    # ---- finding ------------------------------------------------------------------------------------

    def _verified_dir(self, address: TinkerPath, tenant: str) -> tuple[Path, CheckpointRecord]:
        """The checkpoint's directory and its metadata, or CheckpointNotFound. Reads only."""
        path = self._dir_of(address)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode) or path.resolve() != path:
                raise CheckpointNotFound(f"{address.uri} is not a checkpoint directory")
            meta = path / METADATA_FILE
            if not stat.S_ISREG(os.lstat(meta).st_mode):
                raise CheckpointNotFound(f"{address.uri} has no metadata file")
            record = CheckpointRecord.model_validate_json(meta.read_bytes())
        except (OSError, ValueError) as exc:
            raise CheckpointNotFound(f"no checkpoint {address.uri}") from exc
        names_it = (record.tinker_path, record.model_id, record.kind, record.name) == (
            address.uri,
            address.model_id,
            address.kind,
            address.name,
        )
        if not names_it or record.tenant != tenant or not path.is_relative_to(self.root):
            raise CheckpointNotFound(f"no checkpoint {address.uri}")
        return path, record

    async def _indexed(self, address: TinkerPath) -> CheckpointRecord | None:
        raw = await self.store.get(INDEX_NS, address.index_key)
        return None if raw is None else CheckpointRecord.model_validate(raw)

    async def _find(self, tenant: str, address: TinkerPath) -> tuple[Path, CheckpointRecord]:
        await self._behind.settle(address, tenant)
        indexed = await self._indexed(address)
        if indexed is not None and indexed.tenant != tenant:
            raise CheckpointNotFound(f"no checkpoint {address.uri}")
        path, record = self._verified_dir(address, tenant)
        if indexed is None:  # on disk but not indexed (e.g. a memory store after a restart): re-index
            await self.store.put(INDEX_NS, address.index_key, record.model_dump(mode="json"))
        return path, indexed or record

    async def locate(self, tenant: str, tinker_path: str) -> tuple[Path, CheckpointInfo]:
        """The directory and record of the caller's checkpoint at `tinker_path` (one verified lookup),
        or CheckpointNotFound."""
        return await self._find(tenant, parse_tinker_path(tinker_path))

    async def locate_readable(
        self, tenant: str, tinker_path: str, *, files: bool = True
    ) -> tuple[Path, CheckpointInfo]:
        """Like `locate`, but another tenant's checkpoint is found too once its owner published it.
        An unpublished one of another tenant is CheckpointNotFound, exactly as a missing one.

        `files=False`: the caller needs the snapshot's identity, not its files (sampling from a full-weight
        snapshot the engines hold): the caller's checkpoint still being written behind is found at once,
        at the directory it will have, with its provisional record."""
        address = parse_tinker_path(tinker_path)
        pending = self._behind.pending(address)
        if not files and pending is not None and pending.tenant == tenant:
            return self._dir_of(address), pending.provisional
        await self._behind.settle(address, tenant)
        indexed = await self._indexed(address)
        if indexed is None or indexed.tenant == tenant or not indexed.public:
            return await self._find(tenant, address)
        path, _ = self._verified_dir(address, indexed.tenant)
        return path, indexed

    async def locate_indexed(self, tinker_path: str) -> tuple[Path, CheckpointInfo]:
        """The checkpoint at `tinker_path` whoever owns it (the index names the owner; the directory is
        verified against that owner). Only for callers that proved their access another way (a signed
        download URL); CheckpointNotFound when it is not indexed or not intact."""
        address = parse_tinker_path(tinker_path)
        await self._behind.settle(address, None)
        indexed = await self._indexed(address)
        if indexed is None:
            raise CheckpointNotFound(f"no checkpoint {address.uri}")
        path, _ = self._verified_dir(address, indexed.tenant)
        return path, indexed

    async def set_public(
        self, tenant: str, model_id: str, checkpoint_id: str, public: bool
    ) -> CheckpointInfo:
        """Publish (readable by every tenant of this job) or unpublish the caller's checkpoint. Already
        so is no error: the hosted service's 409 is retried by the SDK for 5 minutes before it raises."""
        address = parse_checkpoint_id(model_id, checkpoint_id)
        _, record = await self._find(tenant, address)
        if record.public == public:
            return record
        record = record.model_copy(update={"public": public})
        await self.store.put(INDEX_NS, address.index_key, record.model_dump(mode="json"))
        await self._models.modify(model_id, lambda m: _refreshed(m, record))
        return record

    async def has_public(self, model_id: str) -> bool:
        """Whether any checkpoint of `model_id` is published (its training run is readable by all)."""
        if not is_valid_model_id(model_id):
            return False
        return any(raw.get("public") for _, raw in await self.store.list(INDEX_NS, f"{model_id}/"))

    def files_of(self, directory: Path) -> dict[str, Path]:
        """The downloadable files of a located checkpoint directory, by path relative to it: regular
        files only (no symlink is followed), without the manager's own metadata.json."""
        found: dict[str, Path] = {}
        for dirpath, dirnames, filenames in os.walk(directory):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                path = Path(dirpath) / name
                relative = path.relative_to(directory).as_posix()
                if relative != METADATA_FILE and stat.S_ISREG(os.lstat(path).st_mode):
                    found[relative] = path
        return found

    async def resolve(self, tenant: str, tinker_path: str) -> Path:
        """The directory of the caller's checkpoint at `tinker_path`, or CheckpointNotFound."""
        return (await self.locate(tenant, tinker_path))[0]

    async def info(self, tenant: str, tinker_path: str) -> CheckpointInfo:
        return (await self.locate(tenant, tinker_path))[1]

    async def list(self, tenant: str, model_id: str | None = None) -> list[CheckpointInfo]:
        """The caller's checkpoints (of one model if given), oldest first."""
        if model_id is not None and not is_valid_model_id(model_id):
            return []
        prefix = "" if model_id is None else f"{model_id}/"
        await self._behind.settle_all()  # a save that answered is listed, whole
        records = [CheckpointRecord.model_validate(raw) for _, raw in await self.store.list(INDEX_NS, prefix)]
        return sorted((r for r in records if r.tenant == tenant), key=lambda r: (r.created_at, r.tinker_path))

    async def list_readable(self, tenant: str) -> list[CheckpointInfo]:
        """The caller's checkpoints and every other tenant's published ones, oldest first."""
        await self._behind.settle_all()
        records = [CheckpointRecord.model_validate(raw) for _, raw in await self.store.list(INDEX_NS, "")]
        readable = (r for r in records if r.tenant == tenant or r.public)
        return sorted(readable, key=lambda r: (r.created_at, r.tinker_path))

    async def set_ttl(
        self, tenant: str, model_id: str, checkpoint_id: str, ttl_seconds: float | None
    ) -> CheckpointInfo:
        """Record a new expiry of the caller's checkpoint (None: keep forever), counted from now."""
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise UserError(f"ttl_seconds must be a positive number of seconds or null, got {ttl_seconds!r}")
        address = parse_checkpoint_id(model_id, checkpoint_id)
        _, record = await self._find(tenant, address)
        expires_at = None if ttl_seconds is None else self.clock() + ttl_seconds
        record = record.model_copy(update={"ttl_seconds": ttl_seconds, "expires_at": expires_at})
        await self.store.put(INDEX_NS, address.index_key, record.model_dump(mode="json"))
        return record

    async def reindex_from_disk(self) -> int:
        """Index every valid checkpoint found on disk that the store does not know (e.g. a memory store
        after a restart); returns how many were added. Invalid or aliased directories are skipped."""
        added = 0
        for record in await asyncio.to_thread(self._scan_disk):
            key = parse_tinker_path(record.tinker_path).index_key
            added += await self.store.put_if_absent(INDEX_NS, key, record.model_dump(mode="json"))
        return added

    def _scan_disk(self) -> list[CheckpointRecord]:
        found = []
        for model_dir in sorted(self.root.iterdir()):
            if not is_valid_model_id(model_dir.name) or model_dir.is_symlink():
                continue
            for kind in CHECKPOINT_KINDS:
                kind_dir = model_dir / kind
                names = sorted(kind_dir.iterdir()) if kind_dir.is_dir() and not kind_dir.is_symlink() else []
                for ckpt_dir in names:
                    with contextlib.suppress(CheckpointNotFound, OSError, ValueError):
                        found.append(self._checkpoint_at(model_dir.name, kind, ckpt_dir))
        return found

    def _checkpoint_at(self, model_id: str, kind: str, ckpt_dir: Path) -> CheckpointRecord:
        address = parse_tinker_path(f"{TINKER_SCHEME}{model_id}/{kind}/{ckpt_dir.name}")
        claimed = CheckpointRecord.model_validate_json((ckpt_dir / METADATA_FILE).read_bytes())
        return self._verified_dir(address, claimed.tenant)[1]

    # ---- deleting -----------------------------------------------------------------------------------

    async def delete(self, tenant: str, model_id: str, checkpoint_id: str) -> CheckpointInfo:
        """Delete the caller's checkpoint `<kind>/<name>` of `model_id` (any of CHECKPOINT_KINDS)."""
        address = parse_checkpoint_id(model_id, checkpoint_id)
        path, record = await self._find(tenant, address)
        trash = self._scratch("trash")
        os.rename(path, trash)  # atomic: the name is gone at once, the bytes go after
        await self.store.delete(INDEX_NS, address.index_key)
        await self._models.modify(model_id, lambda m: _without(m, record.tinker_path))
        await asyncio.to_thread(shutil.rmtree, trash)
        return record

    @contextlib.contextmanager
    def pinned(self, tinker_path: str | None) -> Iterator[None]:
        """While in use (a load reading it, a sample from it) the TTL sweep leaves the checkpoint alone."""
        if tinker_path is None:
            yield
            return
        self._pins[tinker_path] += 1
        try:
            yield
        finally:
            self._pins[tinker_path] -= 1
            if not self._pins[tinker_path]:
                del self._pins[tinker_path]

    async def sweep_expired(self, in_use: Collection[str] = ()) -> list[str]:
        """Delete every indexed checkpoint whose TTL has passed, except those pinned or `in_use` (tinker
        paths the caller knows are served, e.g. an open sampler's snapshot); returns their tinker paths."""
        now = self.clock()
        swept = []
        for _, raw in await self.store.list(INDEX_NS):
            record = CheckpointRecord.model_validate(raw)
            if record.tinker_path in self._pins or record.tinker_path in in_use:
                continue
            if record.expires_at is not None and record.expires_at <= now:
                with contextlib.suppress(CheckpointNotFound):
                    await self.delete(record.tenant, record.model_id, record.checkpoint_id)
                    swept.append(record.tinker_path)
        return swept


_LATEST_FIELD = {"weights": "last_checkpoint", "sampler_weights": "last_sampler_checkpoint"}


def _with_latest(model: ModelRecord, record: CheckpointRecord) -> ModelRecord:
    field = _LATEST_FIELD.get(record.kind)  # an external export is nobody's latest checkpoint
    return model if field is None else model.model_copy(update={field: record})


def _refreshed(model: ModelRecord, record: CheckpointRecord) -> ModelRecord:
    """The model's latest-checkpoint copies, updated where they are `record` (e.g. now published)."""
    changes = {
        field: record
        for field in _LATEST_FIELD.values()
        if (current := getattr(model, field)) is not None and current.tinker_path == record.tinker_path
    }
    return model.model_copy(update=changes) if changes else model


def _without(model: ModelRecord, tinker_path: str) -> ModelRecord:
    changes: dict[str, Any] = {}
    for field in ("last_checkpoint", "last_sampler_checkpoint"):
        current = getattr(model, field)
        if current is not None and current.tinker_path == tinker_path:
            changes[field] = None
    return model.model_copy(update=changes) if changes else model


__all__ = [
    "CheckpointExists",
    "CheckpointHandle",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "TinkerPath",
    "parse_tinker_path",
]


def _link_files(files: dict[str, Path], into: Path) -> None:
    for relative, path in files.items():
        target = into / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(path, target)
