"""`launcher report` over a recorded run: the run directory of a real `make demo` (tiny-cpu, ten steps,
then `launcher cancel`), kept in data/recorded_demo as the job wrote it."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.report import (
    RunFacts,
    collect,
    dead_window,
    exit_reason,
    final_state,
    loss_series,
    notable_events,
    summary_rows,
)
from launcher.runs import Run

RECORDED = Path(__file__).parent / "data" / "recorded_demo" / "20261130-215239-tiny-cpu-915e"
RECORDED_DEATH = Path(__file__).parent / "data" / "recorded_death" / "20261130-220639-tiny-cpu-9588"
DRIVER_PHASES = ("ray", "model", "placement", "cells", "weights", "gateway", "serving", "stopping", "stopped")


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    run_dir = tmp_path / RECORDED.name
    shutil.copytree(RECORDED, run_dir)
    return run_dir


def render(run_dir: Path, tmp_path: Path) -> tuple[str, Path]:
    out, png = tmp_path / "report.html", tmp_path / "png"
    result = CliRunner().invoke(main, ["report", str(run_dir), "-o", str(out), "--png", str(png)])
    assert result.exit_code == 0, result.output
    return out.read_text(), png


def test_the_demo_report_shows_bring_up_ten_falling_steps_and_the_cancel(recorded: Path, tmp_path) -> None:
    page, png = render(recorded, tmp_path)
    assert page.count("<svg") == 4 and "<?xml" not in page and "<img" not in page  # self-contained
    summary = page.split('<table id="summary">')[1].split("</table>")[0]
    for phase in DRIVER_PHASES:
        assert f"{phase} " in summary, phase
    assert "10 forward_backward, 10 optim_step" in summary
    assert "CANCELLED" in summary
    assert "exit 143 (ended by SIGTERM); SIGTERM: cancelled, walltime or preemption" in summary
    assert "driver exit 0" in page
    timeline = page.split('<figure id="timeline">')[1].split("</figure>")[0]
    assert "serving 14.8s" in timeline and "exit 143" in timeline  # phase legend, the exit line
    assert sorted(p.name for p in png.iterdir()) == [
        "loss.png",
        "overview.png",
        "push_gaps.png",
        "timeline.png",
        "tokens_per_s.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in png.iterdir())

    (losses,) = loss_series(collect(Run(recorded))).values()
    values = [loss for _, loss in losses]
    assert len(values) == 10
    assert all(later < earlier for earlier, later in itertools.pairwise(values))  # the demo's loss falls


def test_a_running_job_is_drawn_up_to_now(recorded: Path, tmp_path) -> None:
    for name in ("exit_code", "end_reason"):
        (recorded / name).unlink()
    lines = (recorded / "events.jsonl").read_text().splitlines()
    serving = next(i for i, line in enumerate(lines) if '"phase": "serving"' in line)
    (recorded / "events.jsonl").write_text("\n".join(lines[: serving + 1]) + "\n")
    (recorded / "phase").write_text("serving\n")
    record = json.loads((recorded / "job.json").read_text())
    record["state"] = "RUNNING"
    (recorded / "job.json").write_text(json.dumps(record))
    facts = collect(Run(recorded))
    assert final_state(facts) == "running (phase serving)"
    assert exit_reason(facts) == "still running"
    assert facts.end == pytest.approx(facts.generated_at)
    page, _ = render(recorded, tmp_path)
    assert "running (phase serving)" in page


def test_a_killed_trainer_shows_its_death_the_503_window_and_the_exit(tmp_path: Path) -> None:
    """A recorded tiny-cpu job whose trainer rank was SIGKILLed after five steps."""
    run_dir = tmp_path / RECORDED_DEATH.name
    shutil.copytree(RECORDED_DEATH, run_dir)
    facts = collect(Run(run_dir))
    died = facts.rel(facts.of_kind("trainer_dead")[0]["t"])
    start, end = dead_window(facts) or (0.0, 0.0)
    assert start == died and end == facts.rel(facts.of_kind("driver_exit")[0]["t"]) and end > start
    probes_503 = [e for e in facts.of_kind("watchdog") if e["status"] == 503]
    assert probes_503 and all(start <= facts.rel(e["t"]) <= end for e in probes_503)
    page, _ = render(run_dir, tmp_path)
    summary = page.split('<table id="summary">')[1].split("</table>")[0]
    assert "FAILED" in summary
    assert "exit 3 (trainer dead); trainer dead: trainer cell 0 errored: ActorDiedError" in summary
    timeline = page.split('<figure id="timeline">')[1].split("</figure>")[0]
    for mark in ("trainer died", "healthz 503", "watchdog 503", "exit 3"):
        assert mark in timeline, mark


def test_a_dead_trainer_opens_the_503_window_until_the_driver_exits() -> None:
    t0 = 1_000.0
    events = [
        {"t": t0, "kind": "phase", "phase": "serving"},
        {
            "t": t0 + 10,
            "kind": "train",
            "model": "m",
            "command": "forward_backward",
            "tokens": 8,
            "seconds": 1,
        },
        {"t": t0 + 20, "kind": "trainer_dead", "problem": "trainer cell 0 errored: ActorDiedError"},
        {"t": t0 + 23, "kind": "driver_exit", "code": 3},
    ]
    facts = RunFacts(run_id="r", record=None, events=events, exit_code=3, ended_at=t0 + 24)
    assert dead_window(facts) == (20.0, 23.0)
    assert exit_reason(facts) == "exit 3 (trainer dead); trainer dead: trainer cell 0 errored: ActorDiedError"


def test_an_unknown_run_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["report", "nope"])
    assert result.exit_code != 0 and "no run matches 'nope'" in result.output


def test_a_job_that_died_before_the_driver_still_gets_a_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "20261207-022213-tiny-cpu-1526"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "job.log").write_text("[job] ERROR: could not claim this job's ports on the head\n")
    (run_dir / "exit_code").write_text("1\n")
    (run_dir / "job.json").write_text(
        json.dumps({"run_id": run_dir.name, "preset": "tiny-cpu", "scheduler": "local", "job_id": "1"})
    )
    page, _ = render(run_dir, tmp_path)
    assert "exit 1" in page


def test_delta_pushes_are_summed_up_and_each_described() -> None:
    t0 = 1_000.0
    record = {"kind": "push_delta", "mode": "record", "version": 1, "bytes": 4000, "dense_bytes": 4000}
    sent = {"kind": "push_delta", "mode": "send", "version": 2, "bytes": 500, "dense_bytes": 4000}
    events = [
        {"t": t0, **record, "fallback": "no_image", "verified": True},
        {"t": t0 + 5, **sent, "density": 0.1, "forms": {"bitmask_i8": 2}, "verified": True},
        {"t": t0 + 9, "kind": "push_digest_mismatch", "version": 3, "tensors": ["w1", "w2"]},
        {"t": t0 + 9, **record, "version": 3, "fallback": "no_image", "verified": True},
    ]
    facts = RunFacts(run_id="r", record=None, events=events, exit_code=None, ended_at=None)
    row = dict(summary_rows(facts))["delta pushes"]
    assert row == "1 of 3 as deltas, 8.0x fewer bytes; 1 digest mismatches"
    texts = [text for _, _, text in notable_events(facts)]
    assert texts[0] == "full push v1 (no_image), verified True"
    assert texts[1].startswith("delta push v2: 500 bytes (8.0x fewer than full), density 0.1")
    assert texts[2] == "delta push v3: engine digests differ in w1, w2"
    no_deltas = RunFacts(run_id="r", record=None, events=[], exit_code=None, ended_at=None)
    assert "delta pushes" not in dict(summary_rows(no_deltas))
