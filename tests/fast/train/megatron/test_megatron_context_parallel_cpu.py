"""The megatron backend under context parallelism on CPU (gloo, fp32, the tiny model) against itself at CP 1:
per-token logprobs, every loss's elementwise values, the gradient of every parameter (the CP ranks' partial
sums added up, as megatron's DDP does at the step) and, after one AdamW step, every weight. Sequence lengths
are not multiples of 2 x CP (each micro-batch is padded to one). The push source and the state files:
only CP rank 0 sends, each CP rank keeps its own optimizer shard, and a resume is exact. LoRA at CP 2: the
same logprobs and losses, the adapter's gradients in PEFT names (summed over CP), its clipped step.

megatron-core 0.16.1 asks for CUDA in a few places: each rank redirects those to the CPU as
tools/megatron_cpu_check.py does. Skips without the gpu extra (CI has none)."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import pick_master_port
from miles.types import SUPPORTED_LOSSES, AdamParams, Datum

ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
LENGTHS = (5, 9, 7, 13, 1)  # none a multiple of 4 (2 x CP 2) or of 8 (with sequence parallel TP 2)
# micro-batches [5, 9], [7], [13], [1]: in the last, CP rank 1 holds only padding
MICRO_BATCH_TOKENS = 24
# every loss the service supports; cross_entropy last, so the step after it is the same in every layout
LOSSES = (
    ("importance_sampling", {}),
    ("ppo", {}),
    ("cispo", {}),
    ("dro", {"beta": 0.1}),
    ("gspo", {}),
    ("stable_reinforce", {"kl_coeff": 0.1}),
    ("cross_entropy", {}),
)
# for the larger layout: the sequence-level loss (GSPO: a mean over each datum) and the plain one
FEW_LOSSES = (LOSSES[4], LOSSES[-1])
TOL = 1e-5


def _batch(vocab: int) -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for n in LENGTHS:
        tokens = rng.integers(0, vocab, n + 1)
        inputs = {
            "target_tokens": tokens[1:],
            "weights": rng.uniform(0, 1, n).astype(np.float32),
            "logprobs": rng.uniform(-8, -5, n).astype(np.float32),
            "advantages": rng.normal(0, 1, n).astype(np.float32),
        }
        data.append(Datum(tokens[:-1], inputs))
    return data


def _summed_grads(backend: Any) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (its TP shard) summed over the data x context parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    grads = {}
    for name, param in backend.gpt.named_parameters():
        grad = param.main_grad.detach().clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad.numpy()  # numpy: tensors would cross the result queue as shared memory
    return grads


def _run(backend: Any, losses: tuple) -> dict[str, Any]:
    """Each loss's forward_backward (gradients kept, then cleared but the last's), a step, the weights."""
    data = _batch(backend.vocab_size)
    got: dict[str, Any] = {}
    for index, (loss, config) in enumerate(losses):
        out = backend.forward_backward("full", data, loss, config)
        got[loss] = {"logprobs": out.logprobs, "loss": out.elementwise_loss, "grads": _summed_grads(backend)}
        if index + 1 < len(losses):
            backend.ddp.zero_grad_buffer()
    got["norm"] = backend.optim_step("full", ADAM)["grad_norm:mean"]
    got["weights"] = {n: t.numpy().copy() for n, t in backend.iter_hf_weights()}
    got["after"] = backend.forward_backward("full", data, "cross_entropy", {}, forward_only=True).logprobs
    return got


def _run_lora(backend: Any, losses: tuple) -> dict[str, Any]:
    """One rank-4 adapter whose B is made non-zero (so A has gradients), the same in every layout."""
    from megatron.core import parallel_state

    from miles.types import LoraSpec

    backend.create_adapter("a", LoraSpec(rank=4, seed=1))
    adapter = backend.lora.adapters.get("a")
    generator = torch.Generator().manual_seed(0)
    weights = sorted(backend.lora.adapters.hf_weights(adapter).items())  # whole on every rank at pipeline 1
    state = {
        n: w + 0.05 * torch.randn(w.shape, generator=generator) if ".lora_B." in n else w for n, w in weights
    }
    backend.lora.adapters.load_hf(adapter, state)
    data = _batch(backend.vocab_size)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    got: dict[str, Any] = {}
    for index, (loss, config) in enumerate(losses):
        out = backend.forward_backward("a", data, loss, config)
        grads = {n: g.clone() for n, g in backend.lora.hf_gradients("a").items()}  # may be views of .grad
        for grad in grads.values():
            torch.distributed.all_reduce(grad, group=group)
        if index + 1 < len(losses):  # each loss's own gradients; the step takes the last one's
            for param in adapter.parameters():
                param.grad = None
        got[loss] = {
            "logprobs": out.logprobs, "loss": out.elementwise_loss,
            "grads": {n: g.numpy().copy() for n, g in grads.items()},
        }  # fmt: skip
    got["norm"] = backend.optim_step("a", AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))[
        "grad_norm:mean"
    ]
    got["after"] = backend.forward_backward("a", data, "cross_entropy", {}, forward_only=True).logprobs
    return got


def _push_roles(backend: Any) -> str:
    return backend.push_source().role


def _rank(
    rank: int, world: int, port: int, parallel: dict, losses: tuple, model_dir: str, out: str, results: Any
) -> None:
    import torch.distributed as dist

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from tools.megatron_cpu_check import redirect_cuda_to_cpu

    try:
        redirect_cuda_to_cpu()
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=rank == 0)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        lora = parallel.pop("lora", False)
        backend = MegatronBackend(
            model_dir, train_mode="lora" if lora else "full", device="cpu", dtype=torch.float32,
            dist=DistContext(rank, world), parallel=parallel, max_tokens_per_micro_batch=MICRO_BATCH_TOKENS,
        )  # fmt: skip
        if lora:
            results.put((rank, _run_lora(backend, losses)))
            return
        got = _run(backend, losses)
        got["role"] = _push_roles(backend)
        if parallel.get("context", 1) > 1:
            state = Path(out) / "state"
            backend.save_state("full", state, with_optimizer=True)
            data = _batch(backend.vocab_size)
            second = _steps_after(backend, data)
            backend.load_state("full", state, with_optimizer=True)
            resumed = _steps_after(backend, data)
            got["resumed_exactly"] = all(np.array_equal(a, b) for a, b in zip(second, resumed, strict=True))
            got["state_files"] = sorted(p.name for p in state.iterdir())
        results.put((rank, got if rank == 0 else {"role": got["role"]}))
    except BaseException as exc:
        results.put((rank, {"error": repr(exc)}))
        raise


def _steps_after(backend: Any, data: list[Datum]) -> list[np.ndarray]:
    backend.forward_backward("full", data, "cross_entropy", {})
    backend.optim_step("full", ADAM)
    return backend.forward_backward("full", data, "cross_entropy", {}, forward_only=True).logprobs


def run_layout(
    model_dir: Path, out: Path, world: int, parallel: dict, losses: tuple = LOSSES
) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    args = (world, port, parallel, losses, str(model_dir), str(out), results)
    ranks = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    for proc in ranks:
        proc.start()
    try:
        outcome = dict(results.get(timeout=300) for _ in ranks)
    finally:
        for proc in ranks:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert all("error" not in r for r in outcome.values()), outcome
    return outcome


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_layout(tiny_model_dir, tmp_path_factory.mktemp("cp1"), 1, {})[0]


def _close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    """Equal within fp32 rounding of different summation orders: 1e-5, relative for large values."""
    assert len(got) == len(want), what
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=TOL, atol=TOL, err_msg=what)


def assert_same_training(
    got: dict[str, Any], want: dict[str, Any], losses: tuple, compare_grads: bool
) -> None:
    for loss, _ in losses:
        _close(got[loss]["logprobs"], want[loss]["logprobs"], f"{loss} logprobs")
        _close(got[loss]["loss"], want[loss]["loss"], f"{loss} elementwise loss")
        if compare_grads:  # same TP size: the same megatron names and shards
            assert got[loss]["grads"].keys() == want[loss]["grads"].keys()
            for name, grad in want[loss]["grads"].items():
                np.testing.assert_allclose(got[loss]["grads"][name], grad, atol=TOL, rtol=TOL, err_msg=name)
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
    assert got["weights"].keys() == want["weights"].keys()
    for name, weight in want["weights"].items():
        np.testing.assert_allclose(got["weights"][name], weight, atol=TOL, rtol=0, err_msg=name)
    _close(got["after"], want["after"], "logprobs after the step")


def test_context_parallel_2_trains_exactly_as_context_1(
    reference: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert sorted(name for name, _ in LOSSES) == sorted(SUPPORTED_LOSSES)
    outcome = run_layout(tiny_model_dir, tmp_path, 2, {"context": 2})
    assert_same_training(outcome[0], reference, LOSSES, compare_grads=True)
    # the CP ranks hold the same weights: only CP rank 0 sends, and the state keeps one weights file
    assert [outcome[r]["role"] for r in (0, 1)] == ["sender", "idle"]
    assert outcome[0]["resumed_exactly"]
    files = outcome[0]["state_files"]
    assert files == [
        "miles_state.json",
        "optimizer-tp0-cp0-dp0",
        "optimizer-tp0-cp1-dp0",
        "weights-tp0.safetensors",
    ]


def test_context_parallel_2_with_tensor_parallel_2_and_sequence_parallel(
    reference: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    parallel = {"context": 2, "tensor": 2, "sequence_parallel": True}
    outcome = run_layout(tiny_model_dir, tmp_path, 4, parallel, FEW_LOSSES)
    assert_same_training(outcome[0], reference, FEW_LOSSES, compare_grads=False)
    # ranks: TP fastest, then CP; only the first CP rank's TP group takes part in the push
    assert [outcome[r]["role"] for r in range(4)] == ["sender", "gatherer", "idle", "idle"]


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_layout(tiny_model_dir, tmp_path_factory.mktemp("lora-cp1"), 1, {"lora": True}, FEW_LOSSES)[0]


def test_a_lora_adapter_at_context_parallel_2_trains_as_at_context_1(
    lora_reference: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    outcome = run_layout(tiny_model_dir, tmp_path, 2, {"context": 2, "lora": True}, FEW_LOSSES)
    got = outcome[0]
    for loss, _ in FEW_LOSSES:
        _close(got[loss]["logprobs"], lora_reference[loss]["logprobs"], f"{loss} logprobs")
        _close(got[loss]["loss"], lora_reference[loss]["loss"], f"{loss} elementwise loss")
        assert got[loss]["grads"].keys() == lora_reference[loss]["grads"].keys()
        for name, grad in lora_reference[loss]["grads"].items():
            np.testing.assert_allclose(got[loss]["grads"][name], grad, atol=TOL, rtol=TOL, err_msg=name)
    assert got["norm"] == pytest.approx(lora_reference["norm"], rel=1e-5)
    _close(got["after"], lora_reference["after"], "logprobs after the step")
