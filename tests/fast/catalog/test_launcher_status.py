"""`launcher status RUN` shows the catalog table, read from a real gateway app (served by uvicorn) whose
handles are placed by a real CatalogController; `--json` carries the same snapshot."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner

from launcher.catalog_status import catalog_rows, pool_line
from launcher.cli import main
from launcher.runs import create_run, record_submission
from launcher.schedulers import LocalScheduler
from miles.state.local_redis import free_loopback_port
from miles.types import LoraSpec
from tests.fast.catalog.test_catalog_route import KEY, CatalogDouble
from tests.fast.gateway.runtime_double import BASE, double_app


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, CatalogDouble]]:
    runtime = CatalogDouble()
    asyncio.run(runtime.controller.acquire("s1:train:0", BASE, "lora", LoraSpec(rank=4)))
    port = free_loopback_port()
    app = double_app(tmp_path, runtime, {KEY: "alpha"})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", runtime
    server.should_exit = True
    thread.join(timeout=10)


def serving_run(runs_dir: Path, gateway_url: str) -> str:
    """A local job that says its gateway is `gateway_url` and serving, with the run's generated key."""
    run = create_run("catalog", "local", base=runs_dir)
    (run.path / "api_key").write_text(KEY + "\n")
    run.script.write_text(
        "#!/bin/bash\nset -eu\n"
        f'printf "export MILES_GATEWAY_URL=%q\\n" {gateway_url} > "$MILES_RUN_DIR/job.env"\n'
        'touch "$MILES_RUN_DIR/healthy"\nsleep 300\n'
    )
    record_submission(run, LocalScheduler().submit(run.script, run.path))
    deadline = time.monotonic() + 20
    while not (run.path / "healthy").exists():
        assert time.monotonic() < deadline, "the job never became healthy"
        time.sleep(0.05)
    return run.run_id


def test_status_shows_the_catalog_table_and_json(tmp_path, monkeypatch, gateway) -> None:
    url, runtime = gateway
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    run_id = serving_run(tmp_path / "runs", url)
    runner = CliRunner()
    try:
        as_json = runner.invoke(main, ["status", run_id, "--json"], catch_exceptions=False)
        snapshot = json.loads(as_json.output)["catalog"]["snapshot"]
        assert snapshot["models"][0]["instances"][0]["tenants"][0]["model_id"] == "s1:train:0"
        assert snapshot == runtime.controller.snapshot() | {"models": snapshot["models"]}
        text = runner.invoke(main, ["status", run_id], catch_exceptions=False).output
        # an 80-column table wraps its cells: check what does not wrap, and the caption
        assert "catalog" in text and "ready" in text and "10.0.0.1" in text
        assert "free GPUs: 0 of 2 (10.0.0.1 0/2); handles: 1" in text
    finally:
        runner.invoke(main, ["cancel", run_id])


def test_rows_name_models_without_instances() -> None:
    snapshot = {
        "models": [{"name": "a", "resident": False, "instances": []}, {"name": "b", "resident": True}],
        "pool": None,
    }
    assert [row[3] for row in catalog_rows(snapshot)] == ["on demand: none started", "resident"]
    assert pool_line(snapshot) == "pool: fixed at bring-up (no catalog)"
