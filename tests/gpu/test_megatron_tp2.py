"""The megatron backend on two GPUs: TP=2 (and DP=2 at TP=1, PP=2 over micro-batches of at most 40
tokens, and CP=2: context parallel, K and V all-gathered over NCCL) against the transformers backend in fp32.

Claims: the same logprobs and the same gradient norm (so tensor-parallel shards and the data-parallel
gradient SUM are both right); the HF weights gathered over TP are the checkpoint's exactly before any
step; after a step the export loads into transformers with the trainer's logprobs. LoRA at PP=2: with the
transformers backend's adapter (B made non-zero) on both stages, the logprobs, the gradients in PEFT names
(rank 0 collects the second stage's over NCCL), the clipped step's norm, the logprobs after it and the
exported adapter equal the transformers backend's. Each layout runs in two spawned ranks (one GPU each,
NCCL); the reference runs in this process on GPU 0.
Under CP the ranks also run the CP attention in bf16 with grouped-query heads, whose lower-right causal
chunks must reach the flash kernel (the fp32 run takes the materialised-mask path: flash has no fp32).
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs the gpu extra (megatron-core)")

from miles.models.tiny import TinyModelSpec, build_tiny_model
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

pytestmark = pytest.mark.gpu
SMALL = TinyModelSpec(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    intermediate_size=512, seed=5,
)  # fmt: skip
KEY = "full"
ADAM = AdamParams(learning_rate=1e-3, grad_clip_norm=1e9)  # a huge bound: measures the norm, never clips
LORA_SPEC = LoraSpec(rank=8, seed=11)  # attention, MLP and unembedding
LORA_KEY = "tenant-a"
LORA_ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)  # clips: the norm spans both stages


def batch(seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (17, 33, 9, 24, 12):  # five datums: DP shares of 3 and 2
        tokens = rng.integers(0, SMALL.vocab_size, n + 1).astype(np.int64)
        weights = rng.uniform(0.0, 1.0, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def _rank(rank: int, port: int, model_dir: str, parallel: dict, out: str, queue: mp.Queue) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext

    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=timedelta(minutes=3))
        backend = MegatronBackend(
            model_dir, train_mode="full", device=f"cuda:{rank}", dtype=torch.float32,
            dist=DistContext(rank, 2), parallel=parallel,
            max_tokens_per_micro_batch=40 if parallel.get("pipeline", 1) > 1 else 16384,
        )  # fmt: skip
        hf = load_file(f"{model_dir}/model.safetensors")
        gathered = {n: t.cpu() for n, t in backend.iter_hf_weights()}
        exact = gathered.keys() == hf.keys() and all(torch.equal(gathered[n], hf[n]) for n in hf)
        data = batch()
        out0 = backend.forward_backward(KEY, data, "cross_entropy", {})
        metrics = backend.optim_step(KEY, ADAM)
        after = backend.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True)
        backend.export_hf_weights(Path(out))
        result: dict[str, Any] = {
            "exact": exact, "logprobs": out0.logprobs, "grad_norm": metrics["grad_norm:mean"],
            "after": after.logprobs,
        }  # fmt: skip
        if parallel.get("context", 1) > 1:
            result["kernels"] = _cp_attention_kernels(rank)
        queue.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it
        queue.put((rank, {"error": repr(exc)}))
        raise


def _cp_attention_kernels(rank: int) -> list[str]:
    """The SDPA ops one bf16 forward and backward of the CP attention ran (32 heads over 8 KV heads, 8192
    tokens over 2 CP ranks)."""
    from torch.profiler import ProfilerActivity, profile

    from miles.train.megatron.context import ContextSplit, attend_context_parallel

    split = ContextSplit(2, rank, None)
    generator = torch.Generator(device=f"cuda:{rank}").manual_seed(rank)

    def rand(heads: int) -> torch.Tensor:
        shape = (1, heads, 4096, 128)
        return torch.randn(
            shape, generator=generator, device=f"cuda:{rank}", dtype=torch.bfloat16
        ).requires_grad_()

    q, k, v = rand(32), rand(8), rand(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attend_context_parallel(q, k, v, None, split).float().sum().backward()
    return sorted({e.name for e in prof.events() if "attention" in e.name})


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-qwen3-tp2"), SMALL)


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


@pytest.mark.parametrize(
    "parallel",
    [{"tensor": 2, "sequence_parallel": True}, {"tensor": 1}, {"pipeline": 2}, {"context": 2}],
    ids=["tp2", "dp2", "pp2", "cp2"],
)
def test_two_ranks_equal_the_transformers_backend(small_model: Path, tmp_path: Path, parallel: dict) -> None:
    from miles.engines.weight_group import pick_master_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    out = str(tmp_path / "export")
    ranks = [
        ctx.Process(target=_rank, args=(r, port, str(small_model), parallel, out, queue)) for r in (0, 1)
    ]
    for proc in ranks:
        proc.start()
    try:
        results = dict(queue.get(timeout=300) for _ in ranks)
    finally:
        for proc in ranks:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert all("error" not in r for r in results.values()), results
    ref = TransformersBackend(
        str(small_model), train_mode="full", device="cuda:0", dtype=torch.float32, compile_layers=False
    )
    expected = ref.forward_backward(KEY, batch(), "cross_entropy", {})
    ref_norm = ref.optim_step(KEY, ADAM)["grad_norm:mean"]
    for rank, result in results.items():
        # under pipeline parallelism the weights reach rank 0 only
        assert result["exact"] or (rank > 0 and parallel.get("pipeline", 1) > 1)
        np.testing.assert_allclose(flat(result["logprobs"]), flat(expected.logprobs), atol=2e-4, rtol=0)
        assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-3)
        if "kernels" in result:  # CP: the lower-right causal chunks in bf16 run the flash kernel
            assert "aten::_scaled_dot_product_flash_attention" in result["kernels"], result["kernels"]
            assert not any("math" in name for name in result["kernels"]), result["kernels"]
    exported = TransformersBackend(
        out, train_mode="full", device="cuda:0", dtype=torch.float32, compile_layers=False
    )
    got = exported.forward_backward(KEY, batch(), "cross_entropy", {}, forward_only=True)
    np.testing.assert_allclose(flat(got.logprobs), flat(results[0]["after"]), atol=2e-4, rtol=0)


def _lora_rank(rank: int, port: int, model_dir: str, adapter_file: str, out: str, queue: mp.Queue) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext

    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=timedelta(minutes=3))
        backend = MegatronBackend(
            model_dir, train_mode="lora", device=f"cuda:{rank}", dtype=torch.float32,
            dist=DistContext(rank, 2), parallel={"pipeline": 2}, max_tokens_per_micro_batch=40,
        )  # fmt: skip
        backend.create_adapter(LORA_KEY, LORA_SPEC)
        lora = backend.lora
        lora.adapters.load_hf(lora.adapters.get(LORA_KEY), load_file(adapter_file))
        data = batch()
        out0 = backend.forward_backward(LORA_KEY, data, "cross_entropy", {})
        grads = {n: t.cpu().clone() for n, t in lora.hf_gradients(LORA_KEY).items()}
        metrics = backend.optim_step(LORA_KEY, LORA_ADAM)
        after = backend.forward_backward(LORA_KEY, data, "cross_entropy", {}, forward_only=True)
        backend.export_adapter(LORA_KEY, Path(out))
        result: dict[str, Any] = {
            "logprobs": out0.logprobs, "grads": {n: t.numpy() for n, t in grads.items()},
            "grad_norm": metrics["grad_norm:mean"], "after": after.logprobs,
        }  # fmt: skip
        queue.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it
        queue.put((rank, {"error": repr(exc)}))
        raise


def _reference_adapter(model: Path, device: str) -> tuple[TransformersBackend, dict[str, torch.Tensor]]:
    """The transformers backend's adapter with B made non-zero (every tensor then has a gradient)."""
    ref = TransformersBackend(
        str(model), train_mode="lora", device=device, dtype=torch.float32, compile_layers=False
    )
    ref.create_adapter(LORA_KEY, LORA_SPEC)
    adapter = ref.lora.get(LORA_KEY)
    generator = torch.Generator().manual_seed(0)
    state = {
        name: t + 0.02 * torch.randn(t.shape, generator=generator).to(t) if ".lora_B." in name else t
        for name, t in ref.lora.state_dict(adapter).items()
    }
    ref.lora.load_state_dict(adapter, state)
    return ref, {name: t.detach().cpu().contiguous() for name, t in state.items()}


def test_lora_at_pipeline_2_equals_the_transformers_adapter(small_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from miles.engines.weight_group import pick_master_port

    _, state = _reference_adapter(small_model, "cpu")
    adapter_file = tmp_path / "adapter.safetensors"
    save_file(state, str(adapter_file))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    out = tmp_path / "adapter-export"
    args = (port, str(small_model), str(adapter_file), str(out), queue)
    ranks = [ctx.Process(target=_lora_rank, args=(r, *args)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        results = dict(queue.get(timeout=300) for _ in ranks)
    finally:
        for proc in ranks:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert all("error" not in r for r in results.values()), results
    ref, _ = _reference_adapter(small_model, "cuda:0")
    expected = ref.forward_backward(LORA_KEY, batch(), "cross_entropy", {})
    want_grads = {
        n: p.grad.detach().cpu().numpy().copy() for n, p in ref.named_trainable_parameters(LORA_KEY)
    }
    ref_norm = ref.optim_step(LORA_KEY, LORA_ADAM)["grad_norm:mean"]
    after = ref.forward_backward(LORA_KEY, batch(), "cross_entropy", {}, forward_only=True)
    got = results[0]
    assert got["grads"].keys() == want_grads.keys()  # every layer's, both stages'
    for name, want in want_grads.items():
        np.testing.assert_allclose(
            got["grads"][name], want, atol=1e-4 * (np.abs(want).max() + 1e-6), err_msg=name
        )
    assert ref_norm > LORA_ADAM.grad_clip_norm  # so the step depends on the norm over both stages
    for result in results.values():
        np.testing.assert_allclose(flat(result["logprobs"]), flat(expected.logprobs), atol=2e-4, rtol=0)
        assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-3)
        np.testing.assert_allclose(flat(result["after"]), flat(after.logprobs), atol=2e-4, rtol=0)
    exported = load_file(str(out / "adapter_model.safetensors"))
    stepped = {n: t.detach().cpu() for n, t in ref.lora.state_dict(ref.lora.get(LORA_KEY)).items()}
    assert exported.keys() == stepped.keys()
    for name, want in stepped.items():
        np.testing.assert_allclose(exported[name].numpy(), want.numpy(), atol=1e-4, err_msg=name)
