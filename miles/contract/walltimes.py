"""Job time limits as PBS (`-l walltime=`) and Slurm (`--time`) read them, checked before a submit.

A number YAML made of a time is taken in the scheduler's own unit: seconds for a PBS walltime, minutes
for a Slurm time. Fields must be in range (`99:99:99` is refused, not left for the scheduler to read).
"""

from __future__ import annotations

import re

_PBS = re.compile(r"(?:(?:(\d+):)?(\d+):)?(\d+)")
_SLURM_DAYS = re.compile(r"(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?")
_SLURM_CLOCK = re.compile(r"(\d+)(?::(\d+)(?::(\d+))?)?")


def seconds_as_hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def pbs_walltime(value: object) -> str:
    """A PBS walltime `[[HH:]MM:]SS`, minutes and seconds below 60; an integer is seconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{value} is not a walltime: give a positive number of seconds or HH:MM:SS")
        return seconds_as_hms(value)
    text = str(value).strip() if isinstance(value, str) else None
    match = _PBS.fullmatch(text or "")
    if text is None or match is None:
        raise ValueError(f"{value!r} is not a walltime: write [[HH:]MM:]SS, e.g. 12:00:00")
    hours, minutes, seconds = match.groups()
    _below_60(text, minutes=minutes if hours is not None else None, seconds=seconds if minutes else None)
    if not any(int(part or 0) for part in match.groups()):
        raise ValueError(f"{text!r} is a zero walltime: give the job some time, e.g. 01:00:00")
    return text


def slurm_time(value: object) -> str:
    """A Slurm `--time`: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S with fields in range; an integer is minutes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{value} is not a time limit: give a positive number of minutes or HH:MM:SS")
        return str(value)
    text = value.strip() if isinstance(value, str) else ""
    days = _SLURM_DAYS.fullmatch(text)
    clock = _SLURM_CLOCK.fullmatch(text)
    if days:
        _, hours, minutes, seconds = days.groups()
        if int(hours) > 23:
            raise ValueError(f"{text!r}: hours after the days must be 0-23 (e.g. 2-12:00:00)")
        _below_60(text, minutes=minutes, seconds=seconds)
    elif clock:
        _, second, third = clock.groups()
        if third is not None:
            _below_60(text, minutes=second, seconds=third)
        else:
            _below_60(text, seconds=second)
    else:
        raise ValueError(
            f"{value!r} is not a Slurm time: write MM, HH:MM:SS or D-HH:MM:SS, e.g. 12:00:00 or 2-00:00:00"
        )
    if not any(int(n) for n in re.findall(r"\d+", text)):
        raise ValueError(f"{text!r} is a zero time limit: give the job some time, e.g. 01:00:00")
    return text


def _below_60(text: str, **fields: str | None) -> None:
    """Each given field (digits, or None when the time has no such field) must be 0-59."""
    for name, digits in fields.items():
        if digits is not None and int(digits) > 59:
            raise ValueError(f"{text!r}: {name} must be 0-59 (e.g. 12:00:00)")
