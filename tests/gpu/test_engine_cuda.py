"""The CPU engine's model and weight-update classes on CUDA (no HTTP layer: the device has no uvicorn).

A trainer process (TransformersBackend on the same GPU) takes one optimizer step and broadcasts its
weights through a gloo weight-update group; the engine in this process receives them with
`Engine.receive_bucket`/`load_received` and must then give the trainer's logprobs. NCCL cannot connect two
processes on one GPU, hence gloo.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.engines.cpu.engine import Engine
from miles.engines.cpu.runner import ModelRunner
from miles.engines.weight_group import create_weight_update_group, pick_master_port
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum

pytestmark = pytest.mark.gpu
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
GROUP = "gpu-test"


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> np.ndarray:
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])
    return lp[:, 0].numpy()


def test_runner_on_cuda_matches_cpu_and_its_kv_cache(tiny_model_dir: Path) -> None:
    gpu = ModelRunner(str(tiny_model_dir))
    cpu = ModelRunner(str(tiny_model_dir), device=torch.device("cpu"))
    assert gpu.device.type == "cuda"
    full, _ = gpu.forward(PROMPT, None, None)
    np.testing.assert_allclose(full.numpy(), cpu.forward(PROMPT, None, None)[0].numpy(), atol=2e-3)
    # Prefill half, then decode token by token through the cache: the same logits as one forward.
    logits, past = gpu.forward(PROMPT[:4], None, None)
    rows = [logits]
    for token in PROMPT[4:]:
        logits, past = gpu.forward([token], past, None)
        rows.append(logits)
    np.testing.assert_allclose(torch.cat(rows).numpy(), full.numpy(), atol=2e-3)


def _trainer(model_dir: str, port: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    backend = TransformersBackend(model_dir, train_mode="full", device="cuda", compile_layers=False)
    tokens = np.array(PROMPT, dtype=np.int64)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(PROMPT) - 1, np.float32)})
    before = backend.forward_backward("full", [datum], "cross_entropy", {}, forward_only=True)
    backend.forward_backward("full", [datum], "cross_entropy", {})
    backend.optim_step("full", AdamParams(learning_rate=1e-2))
    after = backend.forward_backward("full", [datum], "cross_entropy", {}, forward_only=True)
    named = [(n, t.detach().to("cpu").contiguous()) for n, t in backend.iter_hf_weights()]
    specs = [(n, str(t.dtype), list(t.shape)) for n, t in named]
    queue.put((specs, before.logprobs[0], after.logprobs[0]))
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend="gloo", group_name=GROUP
    )
    group.broadcast(torch.cat([t.view(torch.uint8).flatten() for _, t in named]))
    queue.get(timeout=120)  # the engine has loaded: only then tear the group down
    group.destroy()


async def test_engine_on_cuda_takes_a_gloo_weight_update(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = Engine(str(tiny_model_dir))
    await engine.load()
    await engine.wait_loaded()
    runner = engine.model()
    assert runner.device.type == "cuda"
    port = pick_master_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(str(tiny_model_dir), port, queue), daemon=True)
    trainer.start()
    try:
        specs, before, after = queue.get(timeout=180)
        first = _logprobs(runner.forward(PROMPT, None, None)[0], PROMPT)
        np.testing.assert_allclose(first, before, atol=1e-3)
        assert np.abs(after - before).max() > 1e-2, "the optimizer step should move the logprobs"
        await engine.init_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name=GROUP,
            backend="gloo",
        )
        names, dtypes, shapes = (list(x) for x in zip(*specs, strict=True))
        named = await engine.receive_bucket(GROUP, names, dtypes, shapes, flattened=True)
        await engine.load_received(named)
        queue.put("loaded")
        got = _logprobs(runner.forward(PROMPT, None, None)[0], PROMPT)
        np.testing.assert_allclose(got, after, atol=1e-3)
        assert runner.params["model.embed_tokens.weight"].device.type == "cuda"
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
        await engine.close()
    assert trainer.exitcode == 0
