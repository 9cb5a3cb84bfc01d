"""docs/quickstart.md's Python example, run as written: the tiny-cpu job on the local scheduler through
`launcher.api`, three training steps and a sample through `job.tinker_service_client()`, then cancel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from jobtools import REPO, run_logs

from launcher import api

EXAMPLE_HEADING = "## From Python (notebooks, scripts)"


def quickstart_example() -> str:
    text = (REPO / "docs" / "quickstart.md").read_text()
    section = text.split(EXAMPLE_HEADING, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_quickstart_python_example_trains_samples_and_cancels(tmp_path: Path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(runs))  # for api.runs() below, as for the example
    proxies = {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"}
    env = {k: v for k, v in os.environ.items() if k not in proxies and k != "GATEWAY_DEAD_PROBES"}
    env |= {
        "MILES_RUNS_DIR": str(runs),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TINKER_TELEMETRY": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    script = tmp_path / "example.py"
    script.write_text(quickstart_example())
    try:
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env
        )
    finally:
        for job in api.runs():  # whatever happened, nothing of the job stays running
            if job.record.job_id is not None:
                job.cancel()
    jobs = api.runs()
    assert len(jobs) == 1
    logs = run_logs(jobs[0].run_dir)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-3000:]}\n{logs}"

    lines = out.stdout.splitlines()
    phases = [line.split()[1] for line in lines if line.startswith("phase ")]
    assert phases[-1] == "serving" and len(phases) >= 3, out.stdout
    assert f"serving at {jobs[0].gateway_url}" in lines
    losses = [float(m.group(1)) for line in lines if (m := re.fullmatch(r"step \d: loss ([\d.]+)", line))]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    sample = next(line for line in lines if line.startswith("sample: "))
    assert 1 <= len(sample.removeprefix("sample: ").strip("[]").split(",")) <= 8
    assert lines[-1] == "cancelled: CANCELLED"
    assert jobs[0].status().state == "CANCELLED"
