"""Both shipped GPU presets come up through the real bring-up (real Ray, logical GPUs, CPU engines) with
their hub model names resolved offline from a Hugging Face cache that holds the tiny model under those
names. Only sizes, the engine kind and the backend are overridden, as a user would with `--set`."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import httpx
import pytest
import ray

from launcher.presets import load_preset
from miles.contract.ports import claim_port
from miles.driver.serve import Timeline
from tests.fast.local_ray import init_local_ray

pytestmark = pytest.mark.slow

REVISION = "1" * 40


def cache_model(cache: Path, hub_name: str, model_dir: Path) -> Path:
    """Store `model_dir` in the hub cache layout (refs/main -> snapshots/<rev>) under `hub_name`."""
    repo = cache / f"models--{hub_name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def shrunk(name: str, port: int) -> list[str]:
    """What a user sets to run a GPU preset on one CPU machine: logical GPUs, the CPU engine, small sizes."""
    return [
        "nodes=1",
        "train_nodes=1",
        "gpus_per_node=2",
        "engines.kind=cpu",
        "engines.tp_size=1",
        "engines.per_node=1",
        "engines.server_args={}",
        "model.backend=transformers",
        # megatron's parallel layout does not apply to the transformers backend (refused with it)
        "model.parallel.tensor=1",
        "model.parallel.sequence_parallel=false",
        "model.parallel.recompute=none",
        "model.max_context=512",
        "gateway.host=127.0.0.1",
        f"gateway.port={port}",
        "env={OMP_NUM_THREADS: '1'}",
        "runtime.placement_timeout_s=60",
    ]


@pytest.fixture
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    """A fresh local cluster per test: bring-up's teardown shuts down the Ray it joined."""
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=4, num_gpus=2)
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.parametrize("preset_name", ["qwen3-4b-lora", "qwen3.8-27b-128k"])
async def test_shipped_gpu_preset_comes_up_from_the_hf_cache(
    preset_name: str, ray_session, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.driver.bringup import bring_up

    shipped = load_preset(preset_name, env={})
    hub_name = shipped.model.path
    assert hub_name and not Path(hub_name).exists()  # a hub name, not a directory
    snapshot = cache_model(tmp_path / "hub", hub_name, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    port = claim_port("GATEWAY_PORT")  # bound after Ray's bring-up
    preset = load_preset(preset_name, overrides=shrunk(preset_name, port), env={})
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)

    async with contextlib.AsyncExitStack() as stack:
        runtime = await bring_up(preset, run_dir, Timeline(run_dir), stack)
        key = (run_dir / "api_key").read_text().strip()
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": key}, trust_env=False
        ) as client:
            health = await client.get("/api/v1/healthz")
            capabilities = await client.get("/api/v1/get_server_capabilities")
        assert health.status_code == 200, health.text
        models = capabilities.json()["supported_models"]
        names = [m["model_name"] for m in models]
        assert names == [shipped.model.name, f"{shipped.model.name}:peft:{models[0]['max_context_length']}"]
        assert runtime.card.tokenizer_id == hub_name  # the SDK's AutoTokenizer gets the hub name
        assert Path(runtime.card.tokenizer_path) == snapshot.resolve()  # what the cells loaded
        assert runtime.card.train_mode == shipped.model.train_mode
