"""Weight updates into a CPU engine subprocess (started by its CLI); this process acts as trainer rank 0."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.cpu.server import create_app
from miles.engines.errors import EngineRefused, EngineUnauthorized
from miles.engines.sglang_client import SGLangApiClient
from miles.engines.weight_group import GroupHandle, create_weight_update_group, pick_master_port
from miles.utils.http import close_clients
from miles.utils.serving import ServerThread

API_KEY = "engine-key"
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def engine_process(tiny_model_dir: Path, tmp_path_factory) -> Iterator[str]:
    port = pick_master_port("127.0.0.1")
    log = (tmp_path_factory.mktemp("engine") / "engine.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_TIMEOUT_KEEP_ALIVE": "30"}
    cmd = [
        sys.executable,
        "-m",
        "miles.engines.cpu",
        "--model-path",
        str(tiny_model_dir),
        "--port",
        str(port),
    ]
    proc = subprocess.Popen([*cmd, "--api-key", API_KEY, "--threads", "1"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the engine process exited during startup"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"engine {url} not healthy after {timeout_s} s")


@pytest.fixture
async def client(engine_process: str):
    yield SGLangApiClient(engine_process, api_key=API_KEY)
    await close_clients()


async def join_group(client: SGLangApiClient, group_name: str) -> GroupHandle:
    """Trainer rank 0 and the engine (rank 1) join concurrently, as the push must."""
    port = pick_master_port("127.0.0.1")
    trainer_side = asyncio.to_thread(
        create_weight_update_group,
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=2,
        backend="gloo",
        group_name=group_name,
        timeout_s=60,
    )
    engine_side = client.init_weights_update_group(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        group_name=group_name,
        backend="gloo",
    )
    answer, handle = await asyncio.gather(engine_side, trainer_side)
    assert answer["success"] is True
    return handle


def _broadcast(handle: GroupHandle, tensors: list[torch.Tensor], flattened: bool) -> None:
    if flattened:
        handle.broadcast(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]))
        return
    for work in [handle.broadcast_async(t.contiguous()) for t in tensors]:
        work.wait()


async def push(
    client: SGLangApiClient,
    handle: GroupHandle,
    named: dict[str, torch.Tensor],
    *,
    flattened: bool,
    version: str,
) -> dict:
    tensors = list(named.values())
    answer, _ = await asyncio.gather(
        client.update_weights_from_distributed(
            names=list(named),
            dtypes=[t.dtype for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            group_name=handle.group_name,
            weight_version=version,
            load_format="flattened_bucket" if flattened else None,
        ),
        asyncio.to_thread(_broadcast, handle, tensors, flattened),
    )
    return answer


def _perturbed(model, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (p.detach() + 0.5 * torch.randn(p.shape, generator=gen)).to(dtype)
        for name, p in model.named_parameters()
    }


def _local_model(tiny_model_dir: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    return model


async def _greedy(client: SGLangApiClient) -> dict:
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    return await client.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


async def test_broadcast_weights_reach_the_engine(
    client, tiny_model_dir, reference_model, sequence_logprobs
) -> None:
    before = await _greedy(client)
    handle = await join_group(client, "push-test")
    try:
        await client.pause_generation("abort")
        await client.flush_cache()
        await client.begin_weight_update()
        # bucket 1: per-tensor broadcasts, float32; bucket 2: one flattened buffer in bfloat16
        new = _perturbed(reference_model, seed=1)
        names = list(new)
        first = {n: new[n] for n in names[: len(names) // 2]}
        second = {n: new[n].to(torch.bfloat16) for n in names[len(names) // 2 :]}
        answer = await push(client, handle, first, flattened=False, version="1")
        assert answer["success"] is True and "Weight version updated to 1" in answer["message"]
        assert (await push(client, handle, second, flattened=True, version="2"))["success"] is True
        await client.update_weight_version("2", abort_all_requests=False)
        await client.end_weight_update()
        await client.continue_generation()
    finally:
        await client.destroy_weights_update_group("push-test")
        handle.destroy()

    after = await _greedy(client)
    assert after["meta_info"]["weight_version"] == "2"
    assert (await client.model_info())["weight_version"] == "2"
    assert _logprobs(after) != pytest.approx(_logprobs(before), abs=1e-3), "new weights must change outputs"
    local = _local_model(tiny_model_dir, {**first, **second})
    expected = sequence_logprobs(local, PROMPT, after["output_ids"])
    assert _logprobs(after) == pytest.approx(expected, abs=1e-4)
    generated = local.generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert after["output_ids"] == generated[0, len(PROMPT) :].tolist()


async def test_api_key_is_required_except_for_health(engine_process: str) -> None:
    assert await SGLangApiClient(engine_process).health() is True
    with pytest.raises(EngineUnauthorized):
        await SGLangApiClient(engine_process).model_info()
    with pytest.raises(EngineUnauthorized):
        await SGLangApiClient(engine_process, api_key="wrong").pause_generation()
    await close_clients()


async def test_legacy_engine_updates_without_a_session(tiny_model_dir, reference_model) -> None:
    app = create_app(str(tiny_model_dir), legacy_weight_api=True)
    with ServerThread(app) as srv:
        legacy = SGLangApiClient(srv.url, weight_api="legacy")
        for _ in range(600):
            if await legacy.health():
                break
            await asyncio.sleep(0.05)
        probe = await _post_status(srv.url + "/begin_weight_update")
        assert probe == 404, "legacy builds have no session endpoints"
        handle = await join_group(legacy, "legacy")
        try:
            await legacy.begin_weight_update()  # a no-op in the legacy dialect
            new = {"lm_head.weight": torch.zeros_like(reference_model.lm_head.weight)}
            assert (await push(legacy, handle, new, flattened=False, version="L1"))["success"] is True
            await legacy.end_weight_update()
        finally:
            handle.destroy()
        out = await legacy.generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 3}, return_logprob=True
        )
        # a zero lm_head makes every token equally likely
        assert _logprobs(out) == pytest.approx([-torch.log(torch.tensor(1024.0)).item()] * 3, abs=1e-5)
        await close_clients()


async def _post_status(url: str) -> int:
    async with httpx.AsyncClient() as c:
        return (await c.post(url, json={})).status_code


async def test_trainer_leaving_mid_bucket_fails_the_update_not_the_engine(client) -> None:
    handle = await join_group(client, "abandoned")
    await client.begin_weight_update()
    try:
        receive = asyncio.create_task(
            client.update_weights_from_distributed(
                names=["lm_head.weight"], dtypes=["float32"], shapes=[[1024, 64]], group_name="abandoned"
            )
        )
        await asyncio.sleep(0.5)
        assert not receive.done(), "the engine waits for the trainer's broadcast"
        handle.destroy()  # the trainer gives up on the push: the engine must answer, not hang
        with pytest.raises(EngineRefused, match="Failed to update weights"):
            await asyncio.wait_for(receive, 60)
    finally:
        await client.end_weight_update()
        await client.destroy_weights_update_group("abandoned")
    assert await client.health()
    out = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
