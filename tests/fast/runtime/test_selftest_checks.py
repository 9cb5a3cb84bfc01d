"""The self-test's pure parts: the rows it writes, how it reads Ray's view and the bring-up timeline, the
numbers it reports, and the hints a failed row carries (miles.driver.selftest, miles.contract.selftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.cluster.collective_check import (
    CollectiveReport,
    CollectiveTiming,
    bus_factor,
    median_of_slowest,
    probe_bundles,
)
from miles.contract.engine_args import server_arg_flags
from miles.contract.selftest import (
    STEP_NAMES,
    SelftestRow,
    append_row,
    complete_table,
    hint_for,
    passed,
    read_rows,
)
from miles.driver.selftest import (
    NodeFacts,
    Recorder,
    StepFailed,
    api_key,
    bringup_rows,
    last_logged_error,
    node_problems,
)
from miles.driver.selftest_sdk import kl_sample_train_v1
from miles.rollout.engine_check import check_generate_answer

# ---- Ray's view of the nodes ---------------------------------------------------------------------------


def test_node_problems_name_the_node_that_lacks_gpus_and_a_missing_node() -> None:
    nodes = [NodeFacts("10.0.0.1", 8.0, 64.0), NodeFacts("10.0.0.2", 4.0, 64.0)]
    problems = node_problems(nodes, expected=3, gpus_per_node=8)
    assert problems[0][0] == "" and "Ray sees 2 node(s)" in problems[0][1] and "asks for 3" in problems[0][1]
    assert problems[1] == ("10.0.0.2", "10.0.0.2 offers 4 GPU(s); gpus_per_node is 8")
    assert node_problems(nodes[:1], expected=1, gpus_per_node=8) == []
    # each GPU's bundle books a CPU: the placement would wait 60 s and fail
    ((node, text),) = node_problems([NodeFacts("10.0.0.1", 2.0, 1.0)], expected=1, gpus_per_node=2)
    assert node == "10.0.0.1" and "offers 1 CPU(s)" in text and "ray.num_cpus" in text


# ---- the bring-up timeline ----------------------------------------------------------------------------

MARKS = [
    ("ray", 0.0),
    ("model", 3.0),
    ("placement", 4.0),
    ("cells", 4.1),
    ("weights", 20.0),
    ("gateway", 21.0),
]


def test_bringup_rows_time_each_phase_and_keep_what_the_mark_said() -> None:
    rows = bringup_rows(MARKS, now=21.5, error=None, details={"placement": "2 bundles", "cells": "1 engine"})
    assert [(r.step, r.status, r.seconds) for r in rows] == [
        ("placement", "pass", 1.1),  # model files and the placement group: model -> cells
        ("cells", "pass", 15.9),
        ("weights", "pass", 1.0),
        ("gateway", "pass", 0.5),
    ]
    assert rows[0].detail == "2 bundles" and rows[1].detail == "1 engine"


def test_a_bringup_failure_fails_the_phase_it_happened_in_and_names_the_engines_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "engine-0.log").write_text(
        "Traceback (most recent call last):\n  File x\nValueError: max_running_requests must be at least 1\n"
    )
    (logs / "trainer-rank0.log").write_text("loading\n")
    error = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: EngineHost\n\tip: 10.1.0.7"
    )
    rows = bringup_rows(MARKS[:4], now=9.0, error=error, run_dir=tmp_path)
    assert [(r.step, r.status) for r in rows] == [("placement", "pass"), ("cells", "fail")]
    assert rows[1].log == "logs/engine-0.log" and rows[1].node == "10.1.0.7"  # Ray's error names the node
    assert rows[1].detail.startswith("engine-0.log: ValueError: max_running_requests must be at least 1")
    assert "actor died" in rows[1].detail
    # nothing logged an exception: the error itself, the driver's log
    rows = bringup_rows(MARKS[:2], now=9.0, error=error, run_dir=tmp_path / "empty")
    assert [(r.step, r.status, r.log) for r in rows] == [("placement", "fail", "logs/driver.log")]


def test_last_logged_error_takes_the_newest_log_with_an_exception(tmp_path: Path) -> None:
    import os

    (tmp_path / "engine-0.log").write_text("RuntimeError: old\n")
    (tmp_path / "engine-1.log").write_text("fine\nmiles.errors.EngineRefused: refused\n")
    os.utime(tmp_path / "engine-0.log", (1, 1))
    assert last_logged_error(tmp_path) == ("engine-1.log", "miles.errors.EngineRefused: refused")
    assert last_logged_error(tmp_path / "none") is None


# ---- the recorder ------------------------------------------------------------------------------------


async def test_a_failing_check_writes_its_row_with_the_hint_and_stops_the_sequence(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    async with recorder.step("engine_api") as out:
        out.detail = "engine cell 0: health 3 ms"
    with pytest.raises(StepFailed):
        async with recorder.step("train", log_file="logs/gateway.log") as out:
            out.node = "10.0.0.3"
            raise RuntimeError("trainer cell 0 errored")
    rows = read_rows(tmp_path)
    assert [(r.step, r.status) for r in rows] == [("engine_api", "pass"), ("train", "fail")]
    failed = rows[1]
    assert (failed.node, failed.log, failed.detail) == (
        "10.0.0.3",
        "logs/gateway.log",
        "trainer cell 0 errored",
    )
    assert failed.hint is not None and "docs/troubleshooting.md#self-test-row-train" in failed.hint
    assert recorder.failed == "train"


def test_the_table_lists_every_step_once_and_fails_on_an_unrun_step(tmp_path: Path) -> None:
    for name in STEP_NAMES[:-1]:
        append_row(tmp_path, SelftestRow(step=name, status="pass"))
    with (tmp_path / "selftest.jsonl").open("a") as handle:
        handle.write('{"step": "torn')  # a writer killed mid-line
    rows = read_rows(tmp_path)
    table = complete_table(rows)
    assert [r.step for r in table] == list(STEP_NAMES)
    assert table[-1].status == "not run" and not passed(rows)
    assert passed([*rows, SelftestRow(step=STEP_NAMES[-1], status="pass")])
    assert not passed([*rows, SelftestRow(step=STEP_NAMES[-1], status="fail")])


@pytest.mark.parametrize(
    ("step", "detail", "anchor"),
    [
        ("nodes", "Error: ports the preset pins are in use on vm: GATEWAY_PORT 28999", "#port-clashes"),
        ("gateway", "gateway could not serve on 0.0.0.0:80", "#port-clashes"),
        ("nodes", "node name 'gpu7' does not resolve", "#name-resolution-node-name-x-does-not-resolve"),
        ("collective", "timed out", "#self-test-row-collective"),
    ],
)
def test_a_known_failure_gets_its_own_hint_else_the_steps(step: str, detail: str, anchor: str) -> None:
    hint = hint_for(step, detail)
    assert hint is not None and hint.endswith(f"docs/troubleshooting.md{anchor})")


# ---- the numbers -------------------------------------------------------------------------------------


def test_kl_sample_train_v1_is_the_mean_sampler_minus_trainer_over_sampled_tokens() -> None:
    sampler = [[-1.0, -2.0], [-0.5]]
    trainer = [[-1.5, -2.0], [-1.0]]
    assert kl_sample_train_v1(sampler, trainer) == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    with pytest.raises(ValueError, match="shorter"):
        kl_sample_train_v1([[-1.0, -2.0]], [[-1.0]])


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75) and bus_factor("broadcast", 8) == 1.0
    timing = CollectiveTiming("all_reduce", nbytes=1_000_000_000, ranks=4, seconds=0.5)
    assert timing.algbw_gbps == pytest.approx(2.0) and timing.busbw_gbps == pytest.approx(3.0)
    report = CollectiveReport("nccl", 4, ["a", "a", "b", "b"], [timing])
    assert "4 rank(s) on 2 node(s), nccl" in report.summary(None)
    assert "(12% of nominal 25 GB/s)" in report.summary(25.0)
    assert "nothing crosses a link" in CollectiveReport("nccl", 1, ["a"], []).summary(25.0)


def test_the_collective_time_is_the_median_of_the_slowest_rank_per_iteration() -> None:
    assert median_of_slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == 3.0


def test_nccl_probes_one_per_gpu_and_gloo_one_per_node() -> None:
    assert len(probe_bundles(2, 4, "nccl")) == 8 and all(b["GPU"] == 1.0 for b in probe_bundles(2, 4, "nccl"))
    assert probe_bundles(3, 2, "gloo") == [{"CPU": 0.01}] * 3


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (
            {
                "output_ids": [5, 6],
                "meta_info": {"output_token_logprobs": [[-0.1, 5, None], [-2.0, 6, None]]},
            },
            None,
        ),
        ({"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.1, 5, None]]}}, "has 1 entries"),
        ({"output_ids": [5], "meta_info": {}}, "has none entries"),
        ({"output_ids": [5], "meta_info": {"output_token_logprobs": [[0.5, 5, None]]}}, "not [logprob <= 0"),
        ({"text": "x"}, "no output_ids"),
        ([{"output_ids": [1]}], "one JSON object"),
    ],
)
def test_generate_answers_are_checked_for_logprobs(answer: object, problem: str | None) -> None:
    found = check_generate_answer(answer)
    assert found is None if problem is None else problem in (found or "")


# ---- what the checks read ------------------------------------------------------------------------------


def test_the_selftest_uses_the_jobs_generated_key_or_the_presets_file(tmp_path: Path) -> None:
    from miles.contract.preset import Preset

    preset = Preset.model_validate({"name": "p", "gpus_per_node": 2, "model": {"name": "m", "init": "tiny"}})
    (tmp_path / "api_key").write_text("tml-generated-key-123\n")
    assert api_key(preset, tmp_path) == "tml-generated-key-123"
    keys = tmp_path / "keys"
    keys.write_text("# team keys\ntml-first-key-000000 alice\ntml-second-key-00000 bob\n")
    preset = Preset.model_validate(
        {
            "name": "p",
            "gpus_per_node": 2,
            "model": {"name": "m", "init": "tiny"},
            "gateway": {"api_key": {"file": str(keys)}},
        }
    )
    assert api_key(preset, tmp_path) == "tml-first-key-000000"


def test_engine_flags_keep_a_zero() -> None:
    # 0 == False in Python: a `value not in (None, False)` check dropped --max-running-requests=0
    assert server_arg_flags({"max_running_requests": 0, "random_seed": 0, "x": False, "y": None}) == [
        "--max-running-requests=0",
        "--random-seed=0",
    ]


def test_the_standard_error_says_how_well_the_mean_is_known() -> None:
    from miles.driver.selftest_sdk import standard_error

    assert standard_error([1.0]) == 0.0
    assert standard_error([1.0, -1.0, 1.0, -1.0]) == pytest.approx((4 / 3 / 4) ** 0.5)


async def test_a_check_that_hangs_fails_its_row_after_its_bound(tmp_path: Path) -> None:
    import asyncio

    recorder = Recorder(tmp_path)
    with pytest.raises(StepFailed):
        async with recorder.step("train", timeout_s=0.05) as out:
            out.detail = "waiting for the SDK"
            await asyncio.sleep(5)
    (row,) = read_rows(tmp_path)
    assert (row.step, row.status) == ("train", "fail")
    assert row.detail == "no answer within 0 s (waiting for the SDK)"


async def test_a_failed_row_reads_on_one_line(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    with pytest.raises(StepFailed):
        async with recorder.step("train"):
            raise RuntimeError(
                "trainer cell 0 errored: ActorDiedError:\n\tclass_name: TrainerWorker\n\tip: 1.2.3.4"
            )
    (row,) = read_rows(tmp_path)
    assert row.detail == "trainer cell 0 errored: ActorDiedError: class_name: TrainerWorker ip: 1.2.3.4"


async def test_a_failed_row_says_what_the_runtime_knows_is_broken(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    with pytest.raises(StepFailed):
        async with recorder.step("train", health=lambda: "trainer cell 0 errored: killed"):
            raise RuntimeError("Request failed: ActorDiedError: the actor died")
    (row,) = read_rows(tmp_path)
    assert (
        row.detail
        == "trainer cell 0 errored: killed; the call: Request failed: ActorDiedError: the actor died"
    )
