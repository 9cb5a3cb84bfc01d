"""How much of the shared filesystem the checkpoints fill: per caller (the SDK's checkpoint storage usage)
and for the whole checkpoint root, with a warning before the filesystem fills (docs/gateway.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.state.records import CheckpointRecord

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class FsUsage:
    """The filesystem holding the checkpoint root, as statvfs reports it to this (unprivileged) process."""

    total_bytes: int
    free_bytes: int  # what this process may still write: f_bavail, net of root's reserve (and of a quota
    # the filesystem folds into statvfs, as Lustre and NFS with quotas do)

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.free_bytes / self.total_bytes if self.total_bytes else 0.0


def filesystem_usage(root: Path) -> FsUsage:
    stats = os.statvfs(root)
    return FsUsage(total_bytes=stats.f_blocks * stats.f_frsize, free_bytes=stats.f_bavail * stats.f_frsize)


def usage_item(records: Iterable[CheckpointRecord]) -> dict[str, Any]:
    """The SDK's CurrentCheckpointStorageUsageItem of one caller's checkpoints (pure)."""
    records = list(records)
    size = sum(r.size_bytes or 0 for r in records)
    return {"checkpoint_count": len(records), "size_bytes": size, "size_gigabytes": round(size / GIB, 6)}


def fs_warning(usage: FsUsage, warn_fraction: float) -> str | None:
    """A warning line once the checkpoint filesystem is more than `warn_fraction` full (pure)."""
    if usage.used_fraction < warn_fraction:
        return None
    free, total = usage.free_bytes / GIB, usage.total_bytes / GIB
    return (
        f"the checkpoint filesystem is {usage.used_fraction:.0%} full ({free:.1f} GiB free of {total:.1f}): "
        "delete checkpoints (RestClient.delete_checkpoint) or set TTLs before saves fail"
    )


class StorageWatch:
    """Checked on every gateway sweep: the gauges, and one warning log line per crossing of the threshold."""

    def __init__(self, root: Path, metrics: Any, warn_fraction: float) -> None:
        self.root, self.metrics, self.warn_fraction = root, metrics, warn_fraction
        self.warned = False

    def check(self) -> FsUsage:
        usage = filesystem_usage(self.root)
        self.metrics.checkpoint_fs_free.set(usage.free_bytes)
        self.metrics.checkpoint_fs_used.set(usage.used_fraction)
        warning = fs_warning(usage, self.warn_fraction)
        self.metrics.checkpoint_fs_warning.set(1 if warning else 0)
        if warning and not self.warned:
            log.warning(warning)
        self.warned = warning is not None
        return usage
