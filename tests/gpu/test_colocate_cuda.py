"""Colocation on one GPU: the CPU engine on CUDA gives its memory back (release_memory_occupation with the
memory saver) and takes weights from a trainer-like process through CUDA IPC (update_weights_from_tensor).

No HTTP layer (as test_engine_cuda.py): the Engine's own methods, in the order the routes call them.
"""

from __future__ import annotations

import base64
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.engines.cpu.engine import Engine

pytestmark = pytest.mark.gpu
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


async def _engine(model_dir: Path, **memory: bool) -> Engine:
    engine = Engine(str(model_dir), **memory)
    await engine.load()
    await engine.wait_loaded()
    assert engine.model().device.type == "cuda"
    return engine


async def _logits(engine: Engine) -> torch.Tensor:
    runner = engine.model()
    return (await engine.on_model_thread(lambda: runner.forward(PROMPT, None, None)))[0]


async def test_release_gives_the_weights_memory_back_and_resume_restores_it(tiny_model_dir: Path) -> None:
    engine = await _engine(tiny_model_dir, memory_saver=True, weights_cpu_backup=True)
    try:
        before = await _logits(engine)
        params = engine.model().params
        saved = {n: p.detach().cpu() for n, p in params.items()}
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model().model.parameters())
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

        await engine.release_memory(["weights", "kv_cache"])
        assert allocated - torch.cuda.memory_allocated() >= 0.95 * weight_bytes
        assert torch.cuda.memory_reserved() < reserved, "the allocator's cache goes back to the driver"

        await engine.resume_memory(["weights", "kv_cache"])
        assert torch.cuda.memory_allocated() >= allocated - 0.05 * weight_bytes
        for name, param in params.items():  # the CPU backup restores them bit for bit
            assert param.device.type == "cuda" and torch.equal(param.detach().cpu(), saved[name]), name
        torch.testing.assert_close(await _logits(engine), before, atol=1e-5, rtol=0)
    finally:
        await engine.close()


def _trainer(model_dir: str, out: str, flattened: bool, queue: mp.Queue, done: mp.Queue) -> None:
    """A trainer's place: perturbed weights on the GPU, handed over as CUDA IPC handles (one per tensor,
    or one for a flattened bucket), kept alive until the engine has copied them."""
    from transformers import AutoModelForCausalLM

    from miles.utils.tensor_ipc import flatten_bucket, serialize_flattened_bucket, serialize_named_tensors

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    named = [
        (n, p.detach() + 0.5 * torch.randn(p.shape, generator=gen, device="cuda"))
        for n, p in model.named_parameters()
    ]
    torch.save({n: t.cpu() for n, t in named}, out)
    if flattened:
        buffer, metadata = flatten_bucket(named)
        named.clear()  # only the bucket holds the weights: the engine must read them there
        payload = serialize_flattened_bucket(buffer, metadata)
    else:
        payload = serialize_named_tensors(named)
    queue.put((payload, str(torch.cuda.get_device_properties(0).uuid)))
    done.get(timeout=180)


@pytest.mark.parametrize("flattened", [False, True], ids=["tensors", "flattened"])
async def test_weights_from_a_trainer_process_through_cuda_ipc(
    tiny_model_dir: Path, tmp_path: Path, flattened: bool
) -> None:
    from transformers import AutoModelForCausalLM

    engine = await _engine(tiny_model_dir, memory_saver=True)  # no backup: the push must restore them
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    out = tmp_path / "sent.pt"
    trainer = ctx.Process(
        target=_trainer, args=(str(tiny_model_dir), str(out), flattened, queue, done), daemon=True
    )
    trainer.start()
    try:
        payload, uuid = queue.get(timeout=180)
        assert uuid.encode() in base64.b64decode(payload), "the device travels as the GPU's UUID"
        runner = engine.model()
        # the colocated switch back to sampling: weights first, the push, then the KV cache
        await engine.release_memory(["weights", "kv_cache"])
        await engine.resume_memory(["weights"])
        pointers = {n: p.data_ptr() for n, p in runner.params.items()}
        engine.begin_session()
        engine.check_session("update_weights_from_tensor")
        engine.memory.require_weights()
        async with engine.exclusive_weights():
            await engine.load_tensor_payload(payload, flattened=flattened)
        engine.end_session()
        done.put("copied")
        await engine.resume_memory(["kv_cache"])
        assert {n: p.data_ptr() for n, p in runner.params.items()} == pointers, "copied in, not adopted"

        reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
        reference.load_state_dict(torch.load(out))
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(await _logits(engine), expected, atol=2e-3, rtol=0)
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
        await engine.close()
    assert trainer.exitcode == 0
