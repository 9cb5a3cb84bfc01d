"""The driver's Ray connection is bounded: with no GCS at the job's address it exits with a message
instead of retrying until the job's startup timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.presets import load_preset
from miles.contract.preset import preset_to_yaml
from miles.utils.serving import free_port

pytestmark = pytest.mark.slow


def test_driver_without_a_gcs_fails_with_the_address_it_tried(tmp_path: Path) -> None:
    preset = load_preset("tiny-cpu", overrides=["runtime.ray_connect_timeout_s=3"], env={})
    (tmp_path / "preset.yaml").write_text(preset_to_yaml(preset))
    address = f"127.0.0.2:{free_port('127.0.0.2')}"  # nothing listens there
    env = {**os.environ, "RAY_ADDRESS": address, "MILES_RUN_DIR": str(tmp_path)}
    env["MILES_GATEWAY_PORT"] = str(free_port())  # what the job script hands the driver
    done = subprocess.run(
        [sys.executable, "-m", "miles.driver.serve", str(tmp_path / "preset.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # unbounded, ray.init retries an absent GCS for many minutes
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"no Ray cluster answered at {address} within 3 s" in done.stderr
    assert f"nothing accepts connections on {address}" in done.stderr
    assert (tmp_path / "phase").read_text().strip() == "ray"
