"""`launcher selftest`: the launcher's own rows from plain facts, the follow loop over a run directory the
test writes as the fake job goes, and the CLI's table, JSON and exit codes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher import api, cli_selftest
from launcher import selftest as st
from launcher.cli import main
from launcher.presets import load_preset
from launcher.runs import create_run, record_state, record_submission
from launcher.schedulers import JobState, SchedulerError, State
from miles.contract.preset import PresetError, preset_to_yaml
from miles.contract.roles import Node, plan_roles
from miles.contract.selftest import (
    STEP_NAMES,
    STEPS,
    TROUBLESHOOTING,
    SelftestRow,
    append_row,
    read_rows,
    troubleshooting_anchor,
)

REPO = Path(__file__).resolve().parents[3]
ROLES = [
    (0, "node-a", "10.0.0.1", "trainer"),
    (1, "node-b", "10.0.0.2", "engine"),
    (2, "node-c", "10.0.0.3", "head,engine"),
]
DRIVER_STEPS = [step.name for step in STEPS if step.by == "driver"]


# ---- pure rows ---------------------------------------------------------------------------------------------


def test_scheduler_row_passes_once_the_job_ran_and_fails_when_it_ended_without_running() -> None:
    assert st.scheduler_row(ran=False, ended=None) is None  # still queued: undecided
    ran = st.scheduler_row(ran=True, ended=None, queue_s=42.0)
    assert ran is not None and ran.status == "pass" and ran.seconds == 42.0 and "42 s" in ran.detail

    never = st.scheduler_row(
        ran=False,
        ended=JobState(State.CANCELLED, "CANCELLED by 0", None),
        log="logs/slurm-7.out",
        log_tail=["starting", "slurmstepd: error: invalid account 'x'", ""],
    )
    assert never is not None and never.status == "fail" and never.log == "logs/slurm-7.out"
    assert "CANCELLED by 0" in never.detail and "invalid account 'x'" in never.detail
    assert never.hint and troubleshooting_anchor("scheduler") in never.hint


def test_node_of_log_maps_ray_and_launch_logs_to_roles_tsv_nodes() -> None:
    assert st.node_of_log("ray-head.log", ROLES) == "node-c"
    assert st.node_of_log("logs/ray-worker-1.log", ROLES) == "node-b"
    assert st.node_of_log("launch-0.log", ROLES) == "node-a"
    assert st.node_of_log("launch-9.log", ROLES) is None
    assert st.node_of_log("ray-worker-1.log", None) is None
    assert st.node_of_log("driver.log", ROLES) is None


def test_nodes_row_passes_when_roles_match_and_the_driver_started() -> None:
    assert st.nodes_row(roles=ROLES, expected_nodes=3, driver_started=False, ended=None) is None
    row = st.nodes_row(roles=ROLES, expected_nodes=3, driver_started=True, ended=None, bringup_s=12.0)
    assert row is not None and row.status == "pass" and row.seconds == 12.0
    assert "node-a, node-b, node-c" in row.detail and "head node-c" in row.detail

    short = st.nodes_row(roles=ROLES[:2], expected_nodes=3, driver_started=True, ended=None)
    assert short is not None and short.status == "fail" and "2 node(s)" in short.detail


def test_nodes_row_names_the_node_whose_log_has_the_error_when_the_job_died_before_the_driver() -> None:
    died = JobState(State.FAILED, "F", 1)
    job_log = [
        "2026-12-01 10:00:00 [job] nodes: node-a node-b node-c (head node-c)",
        "ray-worker-1.log:Error: port 6380 is in use",
        "2026-12-01 10:01:00 [job] ERROR: Ray did not form with 3 nodes of this job (see /r/logs/ray-*.log)",
    ]
    errors = [st.NodeError("node-b", "logs/ray-worker-1.log", "Error: port 6380 is in use")]
    row = st.nodes_row(
        roles=ROLES,
        expected_nodes=3,
        driver_started=False,
        ended=died,
        job_log_lines=job_log,
        node_errors=errors,
    )
    assert row is not None and row.status == "fail"
    assert row.detail.startswith("Ray did not form with 3 nodes")
    assert "node-b: Error: port 6380 is in use" in row.detail
    assert row.node == "node-b" and row.log == "logs/ray-worker-1.log"

    # nothing tells the node: the job log is where to look, its `die` line the detail
    bare = st.nodes_row(
        roles=None,
        expected_nodes=3,
        driver_started=False,
        ended=died,
        job_log_lines=[
            "2026-12-01 10:00:00 [job] ERROR: the allocation has 2 nodes but the preset asks for 3"
        ],
    )
    assert bare is not None and bare.node is None and bare.log == st.JOB_LOG
    assert bare.detail == "the allocation has 2 nodes but the preset asks for 3"
    silent = st.nodes_row(roles=None, expected_nodes=3, driver_started=False, ended=died)
    assert silent is not None and "F (exit code 1) before the driver started" in silent.detail


def _watchdog(status: str = "pass", killed: float | None = 1000.0) -> SelftestRow:
    data = {"killed_at": killed} if killed is not None else {}
    return SelftestRow(step="watchdog", status=status, data=data)  # type: ignore[arg-type]


def test_job_end_row_passes_on_exit_3_and_times_the_end_from_the_kill() -> None:
    row = st.job_end_row(
        watchdog=_watchdog(),
        ended=JobState(State.FAILED, "F", 3),
        ended_at=1012.5,
        now=1020.0,
        watchdog_seen_at=1001.0,
    )
    assert row is not None and row.status == "pass" and row.seconds == pytest.approx(12.5)


def test_job_end_row_fails_on_another_exit_code_or_a_job_that_outlives_its_trainer() -> None:
    other = st.job_end_row(
        watchdog=_watchdog(),
        ended=JobState(State.FAILED, "F", 1),
        ended_at=1010.0,
        now=1010,
        watchdog_seen_at=1001,
    )
    assert other is not None and other.status == "fail" and "exit code 1" in other.detail and other.hint

    running = dict(watchdog=_watchdog(), ended=None, ended_at=None, watchdog_seen_at=1001.0, timeout_s=120.0)
    assert st.job_end_row(now=1100.0, **running) is None  # type: ignore[arg-type]
    late = st.job_end_row(now=1121.0, **running)  # type: ignore[arg-type]
    assert late is not None and late.status == "fail" and "cancelled" in late.detail


def test_job_end_row_waits_for_a_passed_watchdog() -> None:
    ended = JobState(State.FAILED, "F", 3)
    for watchdog in (None, _watchdog("fail")):
        assert (
            st.job_end_row(watchdog=watchdog, ended=ended, ended_at=1.0, now=2.0, watchdog_seen_at=1.0)
            is None
        )
    skipped = st.job_end_row(
        watchdog=_watchdog("skip", None), ended=ended, ended_at=1, now=2, watchdog_seen_at=1
    )
    assert skipped is not None and skipped.status == "skip"


def test_times_from_the_record_and_the_job_log() -> None:
    times = {"SUBMITTED": "2026-12-01T10:00:00+00:00", "RUNNING": "2026-12-01T10:02:30+00:00"}
    assert st.queue_seconds(times) == 150.0
    assert st.queue_seconds({"SUBMITTED": "2026-12-01T10:00:00+00:00"}) is None
    lines = [
        "2026-12-01 10:00:00 [job] job 1 (local) preset p, run dir /r",
        "2026-12-01 10:00:01 [job] ray: head ...",
        "2026-12-01 10:00:41 [job] driver: python -m miles.driver.serve",
    ]
    assert st.bringup_seconds(lines) == 41.0
    assert st.bringup_seconds(lines[:2]) is None


# ---- the docs anchors the hints point to -------------------------------------------------------------------


def test_github_slug_matches_githubs_anchors() -> None:
    assert st.github_slug("Self-test row `job_end`") == "self-test-row-job_end"
    assert st.github_slug("`qsub` / `sbatch` refuses the job") == "qsub--sbatch-refuses-the-job"
    assert st.github_slug("Ray does not form: `Ray did not form`") == "ray-does-not-form-ray-did-not-form"
    page = "# A\n```\n# not a heading\n```\n## Port clashes\n### Port clashes\n"
    assert st.heading_anchors(page) == {"a", "port-clashes", "port-clashes-1"}


def test_every_steps_hint_points_at_a_heading_of_the_troubleshooting_page() -> None:
    text = (REPO / TROUBLESHOOTING).read_text()
    if "Self-test row" not in text:
        pytest.skip(f"{TROUBLESHOOTING} has no `### Self-test row <step>` section yet")
    anchors = st.heading_anchors(text)
    missing = [
        step.name for step in STEPS if troubleshooting_anchor(step.name).split("#", 1)[1] not in anchors
    ]
    assert not missing, f"{TROUBLESHOOTING} lacks `### Self-test row `<step>`` for {missing}"


# ---- the follow loop, over a run directory the test writes -------------------------------------------------


class FakeJob(api.Job):
    """A submitted run whose cancel only records that it was asked (the state is the test's to say)."""

    def __init__(self, run, world: World):  # type: ignore[no-untyped-def]
        super().__init__(run)
        self.world = world
        self.cancels = 0

    def cancel(self) -> api.CancelResult:
        self.cancels += 1
        self.world.state = JobState(State.CANCELLED, "CANCELLED", 143)
        return api.CancelResult(self.run_id, "4242", True, "CANCELLED")


class World:
    """A fake clock and scheduler; `at(t, action)` runs `action` once the clock reaches t."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.now = 1000.0
        self.state: JobState | Exception = JobState(State.PENDING, "PD")
        self.actions: list[tuple[float, Callable[[], None]]] = []
        self.polls = 0

    def at(self, t: float, action: Callable[[], None]) -> None:
        self.actions.append((1000.0 + t, action))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += max(seconds, 0.25)
        due = [a for a in self.actions if a[0] <= self.now]
        self.actions = [a for a in self.actions if a[0] > self.now]
        for _, action in sorted(due, key=lambda a: a[0]):
            action()
        assert self.now < 1000.0 + 10_000, "the follow loop never ended"

    def current_state(self, run, record):  # type: ignore[no-untyped-def]
        self.polls += 1
        if isinstance(self.state, Exception):
            raise self.state
        if self.state.state is not State.UNKNOWN:
            record_state(run, self.state.state.value, self.state.exit_code)
        return self.state

    # what the job writes
    def write(self, name: str, text: str, append: bool = True) -> None:
        path = self.run_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if append else "w") as handle:
            handle.write(text)

    def running(self, nodes: int = 3) -> None:
        self.state = JobState(State.RUNNING, "R")
        self.write("logs/job.log", "2026-12-01 10:00:00 [job] job 4242 (local) preset p\n")
        plan = plan_roles(
            [Node(f"node-{c}", f"10.0.0.{i + 1}") for i, c in enumerate("abc"[:nodes])], "node-c", 1
        )
        self.write("roles.tsv", plan.to_tsv(), append=False)

    def driver_starts(self) -> None:
        self.write("logs/job.log", "2026-12-01 10:00:30 [job] driver: python -m miles.driver.serve\n")
        self.write("logs/driver.log", "starting\n")

    def row(self, step: str, status: str = "pass", **fields: object) -> None:
        append_row(self.run_dir, SelftestRow(step=step, status=status, at=self.now, **fields))  # type: ignore[arg-type]

    def ends(self, exit_code: int) -> None:
        self.write("exit_code", f"{exit_code}\n", append=False)
        os.utime(self.run_dir / "exit_code", (self.now, self.now))
        self.state = JobState(State.COMPLETED if exit_code == 0 else State.FAILED, "F", exit_code)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[World, FakeJob]:
    run = create_run("tiny-cpu", "local", base=tmp_path / "runs")
    three = load_preset("tiny-cpu", ["nodes=3", "train_nodes=1"], env={})
    (run.path / "preset.yaml").write_text(preset_to_yaml(three))
    record_submission(run, "4242")
    w = World(run.path)
    monkeypatch.setattr(api, "current_state", w.current_state)
    return w, FakeJob(run, w)


def follow(w: World, job: FakeJob, **kwargs: object) -> tuple[st.SelftestResult, list[SelftestRow]]:
    seen: list[SelftestRow] = []
    kwargs.setdefault("write_files", False)
    result = st.follow_selftest(job, on_row=seen.append, sleep=w.sleep, clock=w.clock, **kwargs)  # type: ignore[arg-type]
    return result, seen


def statuses(result: st.SelftestResult) -> dict[str, str]:
    return {row.step: row.status for row in result.rows}


def test_a_job_that_passes_every_check_and_ends_itself_with_code_3(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.at(5, w.running)
    w.at(8, w.driver_starts)
    for i, step in enumerate(DRIVER_STEPS[:-1]):
        w.at(10 + i, lambda step=step: w.row(step, seconds=0.5))
    w.at(30, lambda: w.row("watchdog", seconds=31.0, data={"killed_at": w.now}))
    w.at(37, lambda: w.ends(3))

    result, seen = follow(w, job, write_files=True)

    assert result.ok and result.exit_status == 0 and job.cancels == 0
    assert [row.step for row in seen] == list(STEP_NAMES)  # each row once, as it arrived, in order
    assert statuses(result) == dict.fromkeys(STEP_NAMES, "pass")
    rows = {row.step: row for row in result.rows}
    assert 6.0 <= (rows["job_end"].seconds or 0) <= 8.0  # the kill at ~1030, the exit_code file at ~1037
    assert rows["nodes"].seconds == 30.0 and "head node-c" in rows["nodes"].detail
    assert result.job_exit_code == 3 and "passed" in result.message
    # the launcher's rows went into selftest.jsonl too; the whole result into selftest.json
    assert {row.step for row in read_rows(w.run_dir)} == set(STEP_NAMES)
    written = json.loads((w.run_dir / st.RESULT_FILE).read_text())
    assert written["ok"] is True and [r["step"] for r in written["rows"]] == list(STEP_NAMES)
    assert result.report_file or any("report" in note for note in result.notes)


def test_a_job_that_dies_before_the_driver_blames_the_node_whose_log_has_the_error(
    world: tuple[World, FakeJob],
) -> None:
    w, job = world

    def ray_fails() -> None:
        w.write("logs/ray-worker-1.log", "claiming ports\nError: NODE_MANAGER_PORT 6380 is in use\n")
        w.write(
            "logs/job.log", "2026-12-01 10:01:00 [job] ERROR: Ray did not form with 3 nodes of this job\n"
        )
        w.ends(1)

    w.at(3, w.running)
    w.at(9, ray_fails)
    result, seen = follow(w, job)

    assert not result.ok and result.exit_status == 1 and job.cancels == 0
    assert [row.step for row in seen] == ["scheduler", "nodes"]
    nodes = next(row for row in result.rows if row.step == "nodes")
    assert nodes.status == "fail" and nodes.node == "node-b" and nodes.log == "logs/ray-worker-1.log"
    assert "Ray did not form" in nodes.detail and "6380 is in use" in nodes.detail
    assert result.log_path(nodes) == str(w.run_dir / "logs/ray-worker-1.log")
    assert all(statuses(result)[s] == "not run" for s in [*DRIVER_STEPS, "job_end"])
    assert "failed at `nodes`" in result.message


def test_a_job_the_scheduler_never_ran_fails_the_scheduler_row(world: tuple[World, FakeJob]) -> None:
    w, job = world

    def refused() -> None:
        w.write("logs/slurm-4242.out", "slurmstepd: error: Unable to create TMPDIR\n")
        w.state = JobState(State.FAILED, "NODE_FAIL", 1)

    w.at(4, refused)
    result, _ = follow(w, job)
    row = result.rows[0]
    assert row.step == "scheduler" and row.status == "fail" and row.log == "logs/slurm-4242.out"
    assert "NODE_FAIL" in row.detail and "TMPDIR" in row.detail
    assert statuses(result)["nodes"] == "not run"


def test_a_job_that_ends_with_another_code_after_the_kill_fails_job_end(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.at(2, w.running)
    w.at(3, w.driver_starts)
    for i, step in enumerate(DRIVER_STEPS):
        w.at(4 + i, lambda step=step: w.row(step, data={"killed_at": w.now} if step == "watchdog" else {}))
    w.at(40, lambda: w.ends(1))
    result, _ = follow(w, job)
    assert statuses(result)["job_end"] == "fail" and not result.ok and job.cancels == 0
    assert "exit code 1" in result.rows[-1].detail


def test_a_job_still_running_after_the_kill_is_cancelled(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.at(2, w.running)
    w.at(3, w.driver_starts)
    for i, step in enumerate(DRIVER_STEPS):
        w.at(4 + i, lambda step=step: w.row(step, data={"killed_at": w.now} if step == "watchdog" else {}))
    result, seen = follow(w, job, job_end_timeout_s=50.0)
    assert job.cancels == 1 and result.cancelled and not result.ok
    job_end = next(row for row in result.rows if row.step == "job_end")
    assert job_end.status == "fail" and "still running 50 s" in job_end.detail
    assert seen[-1].step == "job_end"
    killed = 1000 + 4 + DRIVER_STEPS.index("watchdog")
    assert killed + 50 <= w.now < killed + 50 + 15  # cancelled at the bound, not long after


def test_a_failed_check_ends_the_job_or_the_launcher_cancels_it(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.at(2, w.running)
    w.at(3, w.driver_starts)
    w.at(4, lambda: w.row("ray"))
    w.at(5, lambda: w.row("collective", "fail", detail="NCCL timeout", node="node-b"))
    result, _ = follow(w, job)
    assert job.cancels == 1
    assert statuses(result)["collective"] == "fail" and statuses(result)["placement"] == "not run"
    job_end = next(row for row in result.rows if row.step == "job_end")
    assert job_end.status == "fail" and "after the failed `collective` row" in job_end.detail
    assert 1000 + 5 + st.FAILED_END_GRACE_S <= w.now < 1000 + 5 + st.FAILED_END_GRACE_S + 15
    assert "failed at `collective`: NCCL timeout" in result.message


def test_a_failed_check_after_which_the_job_ends_itself_is_not_cancelled(
    world: tuple[World, FakeJob],
) -> None:
    w, job = world
    w.at(2, w.running)
    w.at(3, w.driver_starts)
    w.at(5, lambda: w.row("ray", "fail", detail="1 GPU on node-b, 2 expected"))
    w.at(8, lambda: w.ends(2))
    result, _ = follow(w, job)
    assert job.cancels == 0 and statuses(result)["ray"] == "fail" and statuses(result)["job_end"] == "not run"
    assert result.job_exit_code == 2


def test_a_job_that_ends_between_rows_fails_the_check_it_was_running(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.at(2, w.running)
    w.at(3, w.driver_starts)
    w.at(4, lambda: w.row("ray"))
    w.at(5, lambda: w.row("collective"))

    def crash() -> None:
        w.write("logs/driver.log", "Traceback (most recent call last):\nRuntimeError: placement exploded\n")
        w.ends(2)

    w.at(7, crash)
    result, _ = follow(w, job)
    placement = next(row for row in result.rows if row.step == "placement")
    assert placement.status == "fail" and placement.log == st.DRIVER_LOG and placement.node == "node-c"
    assert "RuntimeError: placement exploded" in placement.detail
    assert statuses(result)["cells"] == "not run" and job.cancels == 0


def test_the_overall_timeout_cancels_the_job_and_leaves_the_rest_not_run(
    world: tuple[World, FakeJob],
) -> None:
    w, job = world  # the job never leaves the queue
    result, seen = follow(w, job, timeout=100.0)
    assert job.cancels == 1 and result.timed_out and not result.ok and seen == []
    assert set(statuses(result).values()) == {"not run"}
    assert "timed out after 100 s" in result.message
    assert 1100 <= w.now < 1115


def test_scheduler_hiccups_are_tolerated_but_a_run_of_them_is_not(world: tuple[World, FakeJob]) -> None:
    w, job = world
    w.state = SchedulerError("slurmctld timed out")
    w.at(3, lambda: setattr(w, "state", JobState(State.PENDING, "PD")))  # after 3 refusals in a row
    w.at(6, lambda: w.ends(1))
    result, _ = follow(w, job)
    assert w.polls >= 3 and result.job_state == "FAILED"

    w.state = SchedulerError("slurmctld is down")
    with pytest.raises(SchedulerError, match="down"):
        follow(w, job)


def test_run_selftest_submits_the_preset_with_the_selftest_switched_on(
    world: tuple[World, FakeJob], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, job = world
    asked: dict[str, object] = {}

    def fake_submit(preset: str, scheduler: str, overrides: list[str]) -> FakeJob:
        asked.update(preset=preset, scheduler=scheduler, overrides=overrides)
        w.ends(1)
        return job

    monkeypatch.setattr(api, "submit", fake_submit)
    submitted: list[api.Job] = []
    result = st.run_selftest(
        "tiny-cpu",
        scheduler="slurm",
        overrides={"selftest.enabled": False, "watchdog.dead_probes": 2},
        nodes=2,
        on_submit=submitted.append,
        sleep=w.sleep,
        clock=w.clock,
    )
    assert asked["overrides"] == [
        "selftest.enabled=false",
        "watchdog.dead_probes=2",
        "selftest.enabled=true",
        "nodes=2",
    ]
    assert asked["preset"] == "tiny-cpu" and asked["scheduler"] == "slurm" and submitted == [job]
    assert not result.ok and (w.run_dir / st.RESULT_FILE).is_file()


def test_the_selftest_overrides_resolve_in_a_real_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    job = api.submit("tiny-cpu", overrides=st.selftest_overrides({}, None), dry_run=True)
    assert yaml.safe_load(job.run.preset_file.read_text())["selftest"]["enabled"] is True


def test_api_selftest_forwards_to_run_selftest_with_the_same_default_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import inspect

    assert inspect.signature(api.selftest).parameters["timeout"].default == st.DEFAULT_TIMEOUT_S
    got: dict[str, object] = {}
    monkeypatch.setattr(st, "run_selftest", lambda preset, **kw: got.update(kw, preset=preset) or "result")
    assert api.selftest("p", scheduler="pbs", nodes=4) == "result"
    assert got["preset"] == "p" and got["scheduler"] == "pbs" and got["nodes"] == 4


# ---- the CLI -----------------------------------------------------------------------------------------------


def fake_result(tmp_path: Path, failed: bool) -> st.SelftestResult:
    rows = [SelftestRow(step=name, status="pass", seconds=1.5) for name in STEP_NAMES]
    if failed:
        rows[3] = SelftestRow(
            step="collective", status="fail", detail="NCCL timeout", node="node-b", log="logs/driver.log"
        ).with_hint()
        rows[4:] = [SelftestRow(step=name, status="not run") for name in STEP_NAMES[4:]]
    return st.SelftestResult(
        run_id="20261201-100000-tiny-cpu-ab12",
        run_dir=str(tmp_path),
        scheduler="local",
        job_id="4242",
        rows=rows,
        ok=not failed,
        message="self-test failed at `collective`: NCCL timeout" if failed else "self-test passed",
    )


@pytest.fixture
def cli_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, str, str, dict]]:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("NO_COLOR", "1")
    calls: dict = {}

    def invoke(*args: str, failed: bool = False) -> tuple[int, str, str, dict]:
        def fake(preset: str, **kwargs: object) -> st.SelftestResult:
            calls.update(kwargs, preset=preset)
            result = fake_result(tmp_path, failed)
            for row in result.rows[:3]:
                kwargs["on_row"](row)  # type: ignore[operator]
            return result

        monkeypatch.setattr(st, "run_selftest", fake)
        out = CliRunner().invoke(main, ["selftest", *args], catch_exceptions=False)
        return out.exit_code, out.stdout, out.stderr, calls

    return invoke


def test_cli_prints_rows_then_the_table_and_exits_0_when_all_passed(cli_run) -> None:  # type: ignore[no-untyped-def]
    code, out, _, calls = cli_run("-p", "tiny-cpu", "--scheduler", "slurm", "--nodes", "2", "--set", "a=1")
    assert code == 0
    assert calls["preset"] == "tiny-cpu" and calls["scheduler"] == "slurm" and calls["nodes"] == 2
    assert calls["overrides"] == ("a=1",) and calls["timeout"] == st.DEFAULT_TIMEOUT_S
    assert out.count("scheduler") >= 2  # the live line, then the table
    assert "job_end" in out and "the job ends itself" in out and "self-test passed" in out


def test_cli_shows_the_failed_rows_node_log_and_hint_and_exits_1(cli_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, out, _, _ = cli_run("-p", "tiny-cpu", "--timeout", "60", failed=True)
    assert code == 1
    assert "collective failed: NCCL timeout" in out and "node: node-b" in out
    assert f"log:  {tmp_path / 'logs/driver.log'}" in out
    assert "hint: NCCL cannot connect" in out and "self-test-row-collective" in out


def test_cli_json_prints_the_result_and_nothing_else(cli_run) -> None:  # type: ignore[no-untyped-def]
    code, out, err, _ = cli_run("-p", "tiny-cpu", "--json", failed=True)
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False and [row["step"] for row in data["rows"]] == list(STEP_NAMES)
    assert data["rows"][3]["node"] == "node-b" and data["job_id"] == "4242"
    assert "scheduler" in err  # the live rows went to stderr


def test_cli_refused_submit_is_a_clean_error(cli_run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def refused(preset: str, **kwargs: object) -> st.SelftestResult:
        raise api.SubmitRefused("the job would fail at start:\n  model not cached", "fix the preset")

    monkeypatch.setattr(st, "run_selftest", refused)
    result = CliRunner().invoke(main, ["selftest", "-p", "tiny-cpu", "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["hint"] == "fix the preset"


def test_cli_bad_override_fails_before_anything_is_submitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    result = CliRunner().invoke(main, ["selftest", "-p", "tiny-cpu", "--set", "watchdog.bogus=1"])
    assert result.exit_code == 1 and "bogus" in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    with pytest.raises(PresetError):
        st.run_selftest("tiny-cpu", overrides=["watchdog.bogus=1"])


def test_cli_help_says_what_it_does() -> None:
    help_text = " ".join(CliRunner().invoke(main, ["selftest", "--help"]).output.split())
    assert "Prove a preset on this cluster" in help_text and "exits 0 only if all passed" in help_text
    assert cli_selftest.selftest.name == "selftest"


def test_a_die_that_says_see_above_carries_the_error_line_above_it() -> None:
    from launcher.selftest import die_line

    lines = [
        "2026-12-07 02:13:43 [job] node roles: head vm",
        "Error: ports the preset pins are in use on vm: GATEWAY_PORT 28999 (gateway.port: ...)",
        "2026-12-07 02:13:43 [job] ERROR: could not claim this job's ports on the head (see above)",
        "2026-12-07 02:13:43 [job] teardown (exit status 1)",
    ]
    line = die_line(lines)
    assert line is not None and line.startswith("ports the preset pins are in use on vm: GATEWAY_PORT 28999")
    assert line.endswith("(could not claim this job's ports on the head (see above))")
    assert die_line(lines[2:]) == "could not claim this job's ports on the head (see above)"
    assert die_line(["Error: unrelated", *[f"[job] step {i}" for i in range(6)], lines[2]]) == (
        "could not claim this job's ports on the head (see above)"
    )
