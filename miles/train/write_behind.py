"""A named full-weight sampler snapshot written behind: the trainer copies its weights to host memory while
the save waits, and writes the files from that copy in a thread while training and sampling go on.

Writing the 0.6B's 1.2 GB of safetensors took ~1.9 s of the save's answer (docs/colocation.md); the host
copy takes a fraction of that, and the copy cannot change when the trainer's weights do. The gateway
commits the checkpoint once the files are whole (miles.checkpoints.manager, `commit_behind`).

How the two sides meet: the writer leaves a marker beside the staging directory when it is done,
`<staging>.written`, or `<staging>.failed` holding the error. The gateway shares that directory with the
trainer already (the trainer writes every checkpoint into the gateway's staging directory) and polls for a
marker, so waiting never goes through the trainer's command queue (which, colocated, would take the GPUs
back from the engines for a poll). One write runs at a time per trainer process: the next save's copy
waits for it, so host memory holds at most one copy being written and one being made.

Nothing here imports torch: the gateway's side (`wait_written`) runs where torch may be absent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5


def written_marker(staging: Path) -> Path:
    return staging.with_name(staging.name + ".written")


def failed_marker(staging: Path) -> Path:
    return staging.with_name(staging.name + ".failed")


class SnapshotWrites:
    """The trainer process's writes behind, one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def wait(self) -> None:
        """Until the write in flight (if any) is done: call before making the next host copy."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def start(self, staging: Path, write: Callable[[Path], None]) -> None:
        """Write into `staging` in a thread with `write` (it holds the host copy), then leave the marker."""
        self.wait()
        self._thread = threading.Thread(
            target=_write_and_mark, args=(Path(staging), write), name="snapshot-write-behind", daemon=True
        )
        self._thread.start()


def _write_and_mark(staging: Path, write: Callable[[Path], None]) -> None:
    started = time.perf_counter()
    try:
        write(staging)
    except BaseException as exc:  # the gateway reports it against the checkpoint; the trainer goes on
        log.exception("writing the sampler snapshot into %s failed", staging)
        _mark(failed_marker(staging), f"{type(exc).__name__}: {exc}")
        return
    _mark(written_marker(staging), f"{time.perf_counter() - started:.3f}")


def _mark(marker: Path, text: str) -> None:
    """A marker appears whole or not at all (written aside, then renamed)."""
    partial = marker.with_name(marker.name + ".partial")
    try:
        partial.write_text(text)
        os.replace(partial, marker)
    except OSError:
        log.exception("could not leave the marker %s", marker)


WRITES = SnapshotWrites()  # this process's (a trainer rank's)


class WriteBehindFailed(RuntimeError):
    """The files of a snapshot written behind could not be written."""


async def wait_written(
    staging: Path, problem: Callable[[], str | None], timeout_s: float | None = None
) -> float:
    """Until the writer marks `staging` written (its seconds writing) or failed (WriteBehindFailed). Gives up
    when `problem()` names one (the trainer died: no marker will come) or after `timeout_s`. Removes the
    marker it found."""
    delay, deadline = POLL_FIRST_S, None if timeout_s is None else time.monotonic() + timeout_s
    done, failed = written_marker(staging), failed_marker(staging)
    while True:
        if done.exists():
            seconds = float(done.read_text() or 0)
            done.unlink(missing_ok=True)
            return seconds
        if failed.exists():
            why = failed.read_text()
            failed.unlink(missing_ok=True)
            raise WriteBehindFailed(why)
        if (trouble := problem()) is not None:
            raise WriteBehindFailed(f"the trainer went away before the files were written: {trouble}")
        if deadline is not None and time.monotonic() > deadline:
            raise WriteBehindFailed(f"the files were not written within {timeout_s:g} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)
