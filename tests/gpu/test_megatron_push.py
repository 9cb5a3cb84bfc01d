"""The megatron weight push through the sender's own commands (Describe, Join, Broadcast, Close) into the CPU
engine on CUDA: after one optimizer step at TP 1 (one GPU) or TP 2 with sequence parallel (GPUs 0-1, NCCL
between the ranks), the engine's logprobs equal the trainer's. At TP 2 rank 0 sends and rank 1 gathers: its
shards of each bucket's tensors go to rank 0 over the TP group, bucket by bucket (miles.train.megatron.push).
Buckets are small, so several cut a fused QKV or fc1 tensor.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs the gpu extra (megatron-core)")

from miles.models.tiny import TinyModelSpec, build_tiny_model
from miles.types import AdamParams, Datum

pytestmark = pytest.mark.gpu
SMALL = TinyModelSpec(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    intermediate_size=512, seed=5,
)  # fmt: skip
KEY = "full"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 323, 846]
GROUP = "megatron-push-test"
PUSH_BUCKET_BYTES = 256 * 1024  # several buckets, some cutting a fused QKV or fc1 tensor


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-qwen3-push"), SMALL)


def _push_rank(rank: int, tp: int, port: int, model_dir: str, out: mp.Queue, back: mp.Queue) -> None:
    """One step, then the push through the sender's commands, on one trainer rank of `tp`."""
    import torch.distributed as dist

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.utils.buckets import plan_buckets
    from miles.weights.sender import Broadcast, Close, Describe, GroupSpec, Join

    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size=tp, is_master=rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=tp, timeout=timedelta(minutes=3))
        backend = MegatronBackend(
            model_dir, train_mode="full", device=f"cuda:{rank}", dtype=torch.float32,
            dist=DistContext(rank, tp), parallel={"tensor": tp, "sequence_parallel": tp > 1},
        )  # fmt: skip
        tokens = np.array(PROMPT, dtype=np.int64)
        ones = np.ones(len(PROMPT) - 1, np.float32)
        datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": ones})
        backend.forward_backward(KEY, [datum], "cross_entropy", {})
        backend.optim_step(KEY, AdamParams(learning_rate=1e-2))
        after = backend.forward_backward(KEY, [datum], "cross_entropy", {}, forward_only=True).logprobs[0]
        info = Describe().run(backend)
        shared: list[Any] = [None]
        if rank == 0:
            plan = plan_buckets(info.tensors, PUSH_BUCKET_BYTES, flattened=True)
            shared[0] = (GroupSpec(info.master_address, info.master_port, 2, GROUP, "gloo", 120.0), plan)
            out.put((shared[0], after))
        dist.broadcast_object_list(shared, src=0)
        spec, plan = shared[0]
        names = tuple(tuple(m.name for m in bucket) for bucket in plan)
        Join(spec, names, flattened=True).run(backend)
        for k in range(len(names)):
            Broadcast(GROUP, k).run(backend)
        if rank == 0:
            back.get(timeout=120)  # the engine has loaded: only then leave the group
        Close(GROUP).run(backend)
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it instead of waiting for weights that never come
        out.put(repr(exc))
        raise


def _prompt_logprobs(logits: torch.Tensor) -> np.ndarray:
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])
    return lp[:, 0].numpy()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
async def test_the_push_reproduces_the_trainers_logprobs_on_the_engine(
    small_model: Path, tp: int, monkeypatch
) -> None:
    from miles.engines.cpu.engine import Engine
    from miles.engines.weight_group import pick_master_port

    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP {tp} needs {tp} GPUs")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = Engine(str(small_model))
    await engine.load()
    await engine.wait_loaded()
    runner = engine.model()
    ctx = mp.get_context("spawn")
    out, back = ctx.Queue(), ctx.Queue()
    port = pick_master_port("127.0.0.1")
    args = (tp, port, str(small_model), out, back)
    ranks = [ctx.Process(target=_push_rank, args=(r, *args)) for r in range(tp)]
    for proc in ranks:
        proc.start()
    try:
        sent = out.get(timeout=240)
        assert not isinstance(sent, str), f"a megatron rank failed: {sent}"
        (spec, plan), after = sent
        before = _prompt_logprobs(runner.forward(PROMPT, None, None)[0])
        assert np.abs(after - before).max() > 1e-2, "the optimizer step should move the logprobs"
        await engine.init_group(
            master_address=spec.master_address, master_port=spec.master_port, rank_offset=1, world_size=2,
            group_name=GROUP, backend="gloo",
        )  # fmt: skip
        for bucket in plan:
            names, dtypes = [m.name for m in bucket], [m.dtype for m in bucket]
            shapes = [list(m.shape) for m in bucket]
            received = await engine.receive_bucket(GROUP, names, dtypes, shapes, flattened=True)
            await engine.load_received(received)
        back.put("loaded")
        assert len(plan) > 2
        np.testing.assert_allclose(_prompt_logprobs(runner.forward(PROMPT, None, None)[0]), after, atol=1e-3)
    finally:
        for proc in ranks:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        await engine.close()
    assert [proc.exitcode for proc in ranks] == [0] * tp
