"""The watchdog: pure state machine with a fake clock, and the real loop against a real HTTP server."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from miles.job.monitor import (
    EXIT_DEAD,
    EXIT_STARTUP_TIMEOUT,
    ProbeResult,
    Watchdog,
    WatchdogConfig,
    main,
    parse_args,
    run,
)
from tests.fast.launcher.conftest import HEALTHZ_PATH, HealthState

OK = ProbeResult(200, '{"status":"ok"}')
DEAD = ProbeResult(503, '{"status":"unavailable","error":"no trainer cell alive"}')
REFUSED = ProbeResult(None, "ConnectError: refused")
ERROR = ProbeResult(500, "boom")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _drive(results: list[ProbeResult], config: WatchdogConfig, tmp_path: Path) -> tuple[int, list[str], int]:
    """Run the real loop on scripted probe results; return (exit code, log, probes used)."""
    feed = iter(results)
    used = 0
    log: list[str] = []
    clock = FakeClock()

    def probe_once() -> ProbeResult:
        nonlocal used
        used += 1
        return next(feed)

    code = run("http://x/healthz", config, tmp_path / "healthy", probe_once, clock, clock.sleep, log.append)
    return code, log, used


CFG = WatchdogConfig(dead_probes=3, interval_s=30, startup_interval_s=10, startup_timeout_s=100)


def test_dead_before_healthy(tmp_path: Path) -> None:
    code, log, used = _drive([REFUSED, DEAD, DEAD, DEAD], CFG, tmp_path)
    assert (code, used) == (EXIT_DEAD, 4)
    assert "trainer dead before healthy" in log[-1] and "no trainer cell alive" in log[-1]
    assert not (tmp_path / "healthy").exists()


def test_startup_resets_on_other_answers(tmp_path: Path) -> None:
    seq = [DEAD, DEAD, REFUSED, DEAD, DEAD, ERROR, DEAD, DEAD, OK, DEAD, DEAD, DEAD]
    code, log, used = _drive(seq, CFG, tmp_path)
    assert (code, used) == (EXIT_DEAD, len(seq))
    assert (tmp_path / "healthy").exists()
    assert "while serving" in log[-1]


def test_startup_timeout(tmp_path: Path) -> None:
    code, log, used = _drive([REFUSED] * 20, CFG, tmp_path)
    assert code == EXIT_STARTUP_TIMEOUT
    assert used == 11  # t = 0, 10, ..., 100
    assert "not healthy within 100 s" in log[-1]


def test_serving_resets_on_anything_but_503(tmp_path: Path) -> None:
    seq = [OK, DEAD, DEAD, OK, DEAD, DEAD, REFUSED, DEAD, DEAD, ERROR, DEAD, DEAD, DEAD]
    code, _, used = _drive(seq, CFG, tmp_path)
    assert (code, used) == (EXIT_DEAD, len(seq))


def test_zero_disables_the_exit() -> None:
    dog = Watchdog(WatchdogConfig(dead_probes=0, startup_timeout_s=1e9), started_at=0.0)
    dog.observe(OK, 0.0)
    lines: list[str] = []
    for t in range(1, 50):
        lines += dog.observe(DEAD, float(t))
    assert not dog.finished and dog.consecutive_dead == 49
    assert "exit disabled" in lines[-1]


def test_intervals_follow_the_phase() -> None:
    dog = Watchdog(CFG, started_at=0.0)
    assert dog.next_delay() == 10
    dog.observe(OK, 5.0)
    assert dog.next_delay() == 30


def test_finished_watchdog_refuses_more_probes() -> None:
    dog = Watchdog(WatchdogConfig(dead_probes=1), started_at=0.0)
    dog.observe(DEAD, 0.0)
    assert dog.exit_code == EXIT_DEAD
    with pytest.raises(RuntimeError, match="already DEAD"):
        dog.observe(OK, 1.0)


@pytest.mark.parametrize("bad", ["08", "-1", "x", " 4"])
def test_dead_probes_argument_must_be_a_plain_count(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://x", "--dead-probes", bad])
    assert "plain non-negative count" in capsys.readouterr().err


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="dead_probes"):
        WatchdogConfig(dead_probes=-1)
    with pytest.raises(ValueError, match="interval_s"):
        WatchdogConfig(interval_s=0)


def test_main_against_a_real_server(
    health_server: tuple[str, HealthState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, state = health_server
    url = base + HEALTHZ_PATH
    healthy = tmp_path / "healthy"
    monkeypatch.setenv("MILES_RUN_DIR", str(tmp_path))
    args = ["--url", url, "--dead-probes", "2", "--interval", "0.05", "--startup-interval", "0.05"]
    args += ["--startup-timeout", "30"]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(args)))
    thread.start()
    for _ in range(200):
        if healthy.exists():
            break
        thread.join(0.05)
    assert healthy.exists(), "monitor did not mark the gateway healthy"
    state.status = 503
    thread.join(30)
    assert result == [EXIT_DEAD]
