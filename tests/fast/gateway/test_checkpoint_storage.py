"""Checkpoint storage (miles/gateway/services/storage.py): the real SDK's AdminClient reads the caller's
checkpoints (count, bytes) and, in raw HTTP, the checkpoint filesystem's size and free space; the sweep
sets the gauges and logs one warning when the filesystem passes its warning fraction."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import tinker

from miles.gateway.metrics import GatewayMetrics
from miles.gateway.services.storage import FsUsage, StorageWatch, fs_warning, usage_item
from miles.state.records import CheckpointRecord
from tests.fast.gateway.runtime_double import DoubleRuntime
from tests.fast.local_gateway import local_gateway

KEY, OTHER = "tml-storage-owner-0001", "tml-storage-other-0002"
BASE = "Qwen/Qwen3-8B"


def _record(name: str, size: int | None) -> CheckpointRecord:
    path = f"tinker://m/weights/{name}"
    return CheckpointRecord(
        tinker_path=path, tenant="t", model_id="m", kind="weights", name=name, created_at=0.0, size_bytes=size
    )


def test_usage_and_the_warning_rule() -> None:
    item = usage_item([_record("a", 3 << 30), _record("b", None), _record("c", 1 << 29)])
    assert item == {"checkpoint_count": 3, "size_bytes": (3 << 30) + (1 << 29), "size_gigabytes": 3.5}
    assert fs_warning(FsUsage(total_bytes=100, free_bytes=50), 0.9) is None
    text = fs_warning(FsUsage(total_bytes=100 << 30, free_bytes=5 << 30), 0.9) or ""
    assert "95% full (5.0 GiB free of 100.0)" in text and "delete checkpoints" in text


def test_the_watch_sets_its_gauges_and_warns_once_per_crossing(tmp_path: Path, caplog, monkeypatch) -> None:
    from miles.gateway.services import storage

    metrics = GatewayMetrics()
    watch = StorageWatch(tmp_path, metrics, warn_fraction=0.9)
    fill = [0.5]
    monkeypatch.setattr(
        storage,
        "filesystem_usage",
        lambda root: FsUsage(total_bytes=1000, free_bytes=int(1000 * (1 - fill[0]))),
    )
    value = metrics.registry.get_sample_value
    with caplog.at_level(logging.WARNING, logger=storage.__name__):
        watch.check()
        assert value("miles_checkpoint_fs_warning") == 0 and value("miles_checkpoint_fs_free_bytes") == 500
        fill[0] = 0.95
        watch.check()
        watch.check()
        assert value("miles_checkpoint_fs_warning") == 1 and value("miles_checkpoint_fs_used_ratio") == 0.95
        fill[0] = 0.5
        watch.check()
        fill[0] = 0.97
        watch.check()
    warnings = [r for r in caplog.records if "checkpoint filesystem" in r.getMessage()]
    assert len(warnings) == 2, "one line per crossing, not per sweep"


def test_the_sdks_storage_usage_counts_the_callers_checkpoints(tmp_path: Path, tiny_model_dir: Path) -> None:
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    with local_gateway(runtime, tmp_path / "ckpt", {KEY: "alpha", OTHER: "bravo"}) as url:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=BASE, rank=4)
        tc.save_state("one").result()
        tc.save_state("two").result()
        admin = tinker.AdminClient(base_url=url, api_key=KEY)
        (item,) = admin.get_current_checkpoint_storage_usage().result().data
        listed = tinker.RestClient(base_url=url, api_key=KEY).list_user_checkpoints().result().checkpoints
        assert item.checkpoint_count == 2 and item.size_bytes == sum(c.size_bytes or 0 for c in listed) > 0
        assert admin.get_current_checkpoint_storage_usage(project_id="p1").result().data == []
        other = tinker.AdminClient(base_url=url, api_key=OTHER)
        assert other.get_current_checkpoint_storage_usage().result().data == []  # tenants apart
        raw = httpx.get(f"{url}/api/v1/billing/usage/checkpoints/current", headers={"X-API-Key": KEY}).json()
        fs = raw["filesystem"]
        assert 0 < fs["free_bytes"] <= fs["total_bytes"] and 0 <= fs["used_fraction"] <= 1
        with pytest.raises(tinker.AuthenticationError):
            tinker.AdminClient(
                base_url=url, api_key="tml-nobody-0000"
            ).get_current_checkpoint_storage_usage().result()
