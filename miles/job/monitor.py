"""The healthz watchdog the job script runs next to the driver.

    python -m miles.job.monitor --url URL --dead-probes N --interval S --startup-interval S \
        --startup-timeout S

Startup: probe every `--startup-interval` s; N consecutive 503s end the job (exit 3, the trainer died
before it was ever healthy); no answer or any other status resets the count; no 200 within
`--startup-timeout` s ends it too (exit 4). On the first 200 it writes the healthy file and probes every
`--interval` s: N consecutive 503s -> exit 3; anything else (200, refused, timeout, 500) resets the count.
`--dead-probes 0` never exits on 503s (it only logs them).

`Watchdog` is the pure decision logic (a state machine fed probe results and times); `run` does the I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.contract.exit_codes import JobExit
from miles.contract.preset import parse_dead_probes
from miles.contract.tls import pinned_tls

EXIT_DEAD = JobExit.TRAINER_DEAD
EXIT_STARTUP_TIMEOUT = JobExit.STARTUP_TIMEOUT
DEAD_STATUS = 503
HEALTHY_STATUS = 200
BODY_LOG_CHARS = 300


class Phase(enum.StrEnum):
    STARTING = "STARTING"
    SERVING = "SERVING"
    DEAD = "DEAD"
    TIMED_OUT = "TIMED_OUT"


ALLOWED_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.SERVING, Phase.DEAD, Phase.TIMED_OUT}),
    Phase.SERVING: frozenset({Phase.DEAD}),
    Phase.DEAD: frozenset(),
    Phase.TIMED_OUT: frozenset(),
}
EXIT_CODES = {Phase.DEAD: EXIT_DEAD, Phase.TIMED_OUT: EXIT_STARTUP_TIMEOUT}


@dataclass(frozen=True)
class WatchdogConfig:
    dead_probes: int = 4
    interval_s: float = 30.0
    startup_interval_s: float = 10.0
    startup_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.dead_probes < 0:
            raise ValueError(
                f"dead_probes must be 0 (never exit) or a positive count, not {self.dead_probes}"
            )
        for name in ("interval_s", "startup_interval_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")


@dataclass(frozen=True)
class ProbeResult:
    """One GET: the status code (None when nothing answered), the body or the error text."""

    status: int | None
    detail: str = ""

    def describe(self) -> str:
        if self.status is None:
            return f"no answer ({self.detail})"
        return f"HTTP {self.status} {self.detail[:BODY_LOG_CHARS]}".rstrip()


class Watchdog:
    """Pure state machine: feed it each probe result and the time; it says what happened."""

    def __init__(self, config: WatchdogConfig, started_at: float):
        self.config = config
        self.started_at = started_at
        self.phase = Phase.STARTING
        self.consecutive_dead = 0
        self.last: ProbeResult | None = None

    @property
    def finished(self) -> bool:
        return not ALLOWED_TRANSITIONS[self.phase]

    @property
    def exit_code(self) -> int | None:
        return EXIT_CODES.get(self.phase)

    def next_delay(self) -> float:
        return self.config.startup_interval_s if self.phase is Phase.STARTING else self.config.interval_s

    def _move(self, phase: Phase) -> None:
        if phase not in ALLOWED_TRANSITIONS[self.phase]:
            raise RuntimeError(f"watchdog cannot go from {self.phase} to {phase}")
        self.phase = phase

    def observe(self, result: ProbeResult, now: float) -> list[str]:
        """Take one probe result; return the log lines it deserves (the phase may change)."""
        if self.finished:
            raise RuntimeError(f"watchdog already {self.phase}")
        self.last = result
        lines: list[str] = []
        if result.status == DEAD_STATUS:
            self.consecutive_dead += 1
            lines.append(self._dead_probe_line(result))
            if self.config.dead_probes and self.consecutive_dead >= self.config.dead_probes:
                when = "before healthy" if self.phase is Phase.STARTING else "while serving"
                self._move(Phase.DEAD)
                lines.append(
                    f"trainer dead {when}: {self.consecutive_dead} consecutive 503s from healthz; "
                    f"ending the job (exit {EXIT_DEAD}); last body: {result.detail[:BODY_LOG_CHARS]}"
                )
                return lines
        else:
            if self.consecutive_dead:
                lines.append(f"dead-probe count reset by {result.describe()}")
            self.consecutive_dead = 0
            if self.phase is Phase.STARTING and result.status == HEALTHY_STATUS:
                self._move(Phase.SERVING)
                lines.append(
                    f"gateway healthy after {now - self.started_at:.1f} s; watching every "
                    f"{self.config.interval_s:g} s"
                )
                return lines
        if self.phase is Phase.STARTING and now - self.started_at >= self.config.startup_timeout_s:
            self._move(Phase.TIMED_OUT)
            lines.append(
                f"gateway not healthy within {self.config.startup_timeout_s:g} s; ending the job "
                f"(exit {EXIT_STARTUP_TIMEOUT}); last probe: {result.describe()}"
            )
        return lines

    def _dead_probe_line(self, result: ProbeResult) -> str:
        limit = self.config.dead_probes
        of = f"{self.consecutive_dead}/{limit}" if limit else f"{self.consecutive_dead} (exit disabled)"
        return f"healthz 503 ({of}): {result.detail[:BODY_LOG_CHARS]}"


def probe(url: str, timeout_s: float, verify: ssl.SSLContext | bool = True) -> ProbeResult:
    """GET the URL once; any failure to get an answer is a result, not an exception."""
    try:
        # never through http_proxy
        response = httpx.get(url, timeout=timeout_s, trust_env=False, verify=verify)
    except httpx.HTTPError as exc:
        return ProbeResult(status=None, detail=f"{type(exc).__name__}: {exc}")
    return ProbeResult(status=response.status_code, detail=response.text.strip())


def run(
    url: str,
    config: WatchdogConfig,
    healthy_file: Path | None,
    probe_once: Callable[[], ProbeResult],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> int:
    """Probe until the watchdog finishes; return the exit code for the job."""
    dog = Watchdog(config, started_at=clock())
    log(
        f"watchdog: {url} every {config.startup_interval_s:g} s until healthy (timeout "
        f"{config.startup_timeout_s:g} s), then every {config.interval_s:g} s; dead after "
        f"{config.dead_probes or 'never (0 = exit disabled)'} consecutive 503s"
    )
    while True:
        was, dead_before = dog.phase, dog.consecutive_dead
        result = probe_once()
        for line in dog.observe(result, clock()):
            log(line)
        if result.status == DEAD_STATUS or dog.phase is not was or dead_before:
            record_probe(result, dog)
        if dog.phase is Phase.SERVING and was is Phase.STARTING and healthy_file is not None:
            healthy_file.write_text(f"{time.time():.3f}\n")
            log(f"wrote {healthy_file}")
        if dog.finished:
            return dog.exit_code or 0
        sleep(dog.next_delay())


def record_probe(result: ProbeResult, dog: Watchdog) -> None:
    """A probe worth the run's event log (a 503, the first answer after 503s, a phase change: the
    report's 503 window). Nothing when no event log is configured ($MILES_RUN_DIR unset)."""
    try:
        from miles.contract import events
    except ImportError:  # the launcher without the runtime: no event log
        return
    events.record(
        "watchdog",
        status=result.status,
        phase=dog.phase.value,
        consecutive_503=dog.consecutive_dead,
        detail=result.detail[:BODY_LOG_CHARS],
    )


def _count(text: str) -> int:
    try:
        return parse_dead_probes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miles.job.monitor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway's healthz URL")
    parser.add_argument(
        "--dead-probes", type=_count, default=4, help="consecutive 503s that end the job (0 = never)"
    )
    parser.add_argument(
        "--interval", type=_positive, default=30.0, help="seconds between probes once healthy"
    )
    parser.add_argument(
        "--startup-interval", type=_positive, default=10.0, help="seconds between startup probes"
    )
    parser.add_argument(
        "--startup-timeout", type=_positive, default=3600.0, help="seconds to wait for healthy"
    )
    parser.add_argument("--probe-timeout", type=_positive, default=5.0, help="seconds one probe may take")
    parser.add_argument("--healthy-file", type=Path, default=None, help="default: $MILES_RUN_DIR/healthy")
    parser.add_argument(
        "--tls-cert", type=Path, default=None, help="the gateway's TLS certificate, when it serves https"
    )
    return parser.parse_args(argv)


def _log_line(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} monitor: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    healthy_file = args.healthy_file
    if healthy_file is None and os.environ.get("MILES_RUN_DIR"):
        healthy_file = Path(os.environ["MILES_RUN_DIR"]) / "healthy"
    config = WatchdogConfig(args.dead_probes, args.interval, args.startup_interval, args.startup_timeout)
    with contextlib.suppress(ImportError):
        from miles.contract import events

        events.configure_from_env()
    probe_timeout = min(args.probe_timeout, config.interval_s, config.startup_interval_s)
    verify = pinned_tls(args.tls_cert) if args.tls_cert else True
    return run(args.url, config, healthy_file, lambda: probe(args.url, probe_timeout, verify), log=_log_line)


if __name__ == "__main__":
    sys.exit(main())
