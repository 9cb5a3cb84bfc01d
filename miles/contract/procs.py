"""Process identity on Linux: a pid plus its start time tells a live process from a later one that reused
the pid (local jobs, port claims)."""

from __future__ import annotations

from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None (gone, zombie, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime 22
    if fields[0] == "Z":
        return None
    return int(fields[19])
