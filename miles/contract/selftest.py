"""The self-test's rows: what the job's driver writes to RUN_DIR/selftest.jsonl as each check ends, and what
`launcher selftest` reads back, adds its own rows to (the scheduler's, and the job's end) and prints.

One row per check, in the order of STEPS. A failed row names the step, the node, the log file and a hint
(an entry of docs/troubleshooting.md); the checks after a failure are not run (the job ends), and the
launcher reports them as `not run`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

SELFTEST_FILE = "selftest.jsonl"
TROUBLESHOOTING = "docs/troubleshooting.md"

Status = Literal["pass", "fail", "skip", "not run"]


@dataclass(frozen=True)
class StepSpec:
    """One check of the sequence: who runs it, what it proves, where to look when it fails."""

    name: str
    title: str
    by: Literal["launcher", "driver"]
    hint: str


def troubleshooting_anchor(step: str) -> str:
    """The step's entry in docs/troubleshooting.md: the heading "### Self-test row `<step>`"."""
    return f"{TROUBLESHOOTING}#self-test-row-{step}"


STEPS: tuple[StepSpec, ...] = (
    StepSpec(
        "scheduler",
        "the scheduler starts the job",
        "launcher",
        "the scheduler's answer is in the job log; check the queue and account",
    ),
    StepSpec(
        "nodes",
        "the job claims its ports and starts Ray on every node",
        "launcher",
        "a node that does not join: its launch log says why",
    ),
    StepSpec(
        "ray",
        "Ray sees every node's GPUs and CPUs",
        "driver",
        "a node with fewer GPUs than gpus_per_node: check CUDA_VISIBLE_DEVICES and the job's GPU request",
    ),
    StepSpec(
        "collective",
        "all-reduce and broadcast across every GPU",
        "driver",
        "NCCL cannot connect or is slow: NCCL_SOCKET_IFNAME / NCCL_IB_HCA, firewalls between nodes",
    ),
    StepSpec(
        "placement",
        "the model's files ready, the job's GPUs reserved (head last)",
        "driver",
        "Ray could not reserve the job's bundles",
    ),
    StepSpec(
        "cells",
        "engines and trainer start",
        "driver",
        "an engine that does not start: its log names the flag or file it refused",
    ),
    StepSpec(
        "weights",
        "the engines get their first weights",
        "driver",
        "the first push failed: the trainer-engine group (NCCL/gloo) or an engine's update routes",
    ),
    StepSpec(
        "gateway",
        "the gateway serves",
        "driver",
        "the gateway's port is taken or unreachable",
    ),
    StepSpec(
        "engine_api",
        "every engine call the runtime makes",
        "driver",
        "the engine refused a call the runtime makes: its version or flags differ from the contract",
    ),
    StepSpec(
        "train",
        "a training step through the tinker SDK",
        "driver",
        "the trainer failed a step: its log has the traceback",
    ),
    StepSpec(
        "push",
        "the trainer's weights reach the engines",
        "driver",
        "save_weights_and_get_sampling_client failed: the push or the adapter load",
    ),
    StepSpec(
        "kl",
        "sampler and trainer agree on logprobs",
        "driver",
        "the engine computes different logprobs than the trainer: dtype, model files or kernels differ",
    ),
    StepSpec(
        "watchdog",
        "a dead trainer turns healthz 503",
        "driver",
        "healthz kept answering 200 after the trainer died",
    ),
    StepSpec(
        "job_end",
        "the job ends itself",
        "launcher",
        "the job outlived its trainer: the driver's exit and the watchdog's probes",
    ),
)
STEP_NAMES = tuple(step.name for step in STEPS)
SPECS = {step.name: step for step in STEPS}


class SelftestRow(BaseModel):
    step: str
    status: Status
    seconds: float | None = None
    detail: str = ""
    node: str | None = None  # the node the check ran on or failed on
    log: str | None = None  # the log file to read (relative to the run dir, or absolute)
    hint: str | None = None  # filled from STEPS for failures when the writer gives none
    data: dict[str, Any] = Field(default_factory=dict)  # the check's numbers, for --json and scripts
    at: float = Field(default_factory=time.time)

    def with_hint(self) -> SelftestRow:
        if self.status != "fail" or self.hint:
            return self
        hint = hint_for(self.step, self.detail)
        return self.model_copy(update={"hint": hint}) if hint else self


# Failures whose text says more than the step does: (pattern in the row's detail, hint, troubleshooting
# heading's anchor). The first match wins; else the step's own hint.
KNOWN_FAILURES: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r"ports the preset pins are in use|address already in use|could not serve on", re.I),
        "a port the job needs is taken on that node: unpin it (the job then picks a free one) or free it",
        "port-clashes",
    ),
    (
        re.compile(r"does not resolve", re.I),
        "a node name from the scheduler does not resolve on the head: check /etc/hosts or DNS",
        "name-resolution-node-name-x-does-not-resolve",
    ),
    (
        re.compile(r"bash >= 5\.1 is needed", re.I),
        "the job's bash is too old: put bash >= 5.1 first on PATH in the job's environment",
        "the-job-dies-at-once-bash--51-is-needed-wait--n--p-this-is-4x",
    ),
)


def hint_for(step: str, detail: str) -> str | None:
    """The hint of a failed row: a known failure's, else its step's; with the troubleshooting entry."""
    for pattern, hint, anchor in KNOWN_FAILURES:
        if pattern.search(detail):
            return f"{hint} ({TROUBLESHOOTING}#{anchor})"
    spec = SPECS.get(step)
    if spec is None:
        return None
    return f"{spec.hint} ({troubleshooting_anchor(spec.name)})"


def append_row(run_dir: Path, row: SelftestRow) -> None:
    """One line per row, one write on an O_APPEND file: a reader never sees half a row."""
    data = (row.with_hint().model_dump_json() + "\n").encode()
    fd = os.open(Path(run_dir) / SELFTEST_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_rows(run_dir: Path) -> list[SelftestRow]:
    """The rows written so far; a torn last line (a writer killed mid-write) is left out."""
    return list(_rows(Path(run_dir) / SELFTEST_FILE))


def _rows(path: Path) -> Iterator[SelftestRow]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            yield SelftestRow.model_validate(json.loads(line))
        except ValueError:
            continue


def complete_table(rows: list[SelftestRow]) -> list[SelftestRow]:
    """Every step once, in STEPS order: the last row written for a step, `not run` for a step none ran."""
    latest = {row.step: row for row in rows}
    table = [latest.get(name) or SelftestRow(step=name, status="not run") for name in STEP_NAMES]
    extra = [row for row in rows if row.step not in SPECS]
    return table + extra


def passed(rows: list[SelftestRow]) -> bool:
    """Every step passed or was skipped for a reason (no step failed or stayed unrun)."""
    table = complete_table(rows)
    return all(row.status in ("pass", "skip") for row in table)
