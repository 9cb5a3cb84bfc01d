"""The megatron backend under context parallelism on CPU (gloo, fp32, the tiny model) against itself at CP 1:
per-token logprobs, every loss's elementwise values, the gradient of every parameter (the CP ranks' partial
sums added up, as megatron's DDP does at the step) and, after one AdamW step, every weight. Sequence lengths
are not multiples of 2 x CP (each micro-batch is padded to one). The push source and the state files:
only CP rank 0 sends, each CP rank keeps its own optimizer shard, and a resume is exact. LoRA at CP 2: the
same logprobs and losses, the adapter's gradients in PEFT names (summed over CP), its clipped step. Across
layouts: CP 1 and CP 2 run at once and each loads the other's state (full: the weights, the optimizer
refused on every rank; LoRA: with its optimizer). Each layout's processes run full fine-tuning, then LoRA, on
one process group (a process costs seconds of imports on CI's two cores).

megatron-core 0.16.1 asks for CUDA in a few places: each rank redirects those to the CPU as
tools/megatron_cpu_check.py does. Skips without the gpu extra (CI has none)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from safetensors.torch import load_file

from miles.contract.losses import LOSS_NAMES
from miles.engines.weight_group import pick_master_port
from miles.types import AdamParams, Datum
from tests.fast.train.megatron.ranks import join_gloo, running

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
    # a datum as long as the model's context, which is not a multiple of 2 x CP: padded past it
    longest = np.arange(backend.max_context) % backend.vocab_size
    datum = Datum(
        longest, {"target_tokens": np.roll(longest, -1), "weights": np.ones(len(longest), np.float32)}
    )
    got["longest"] = backend.forward_backward("a", [datum], "cross_entropy", {}, forward_only=True).logprobs
    return got


def _push_roles(backend: Any) -> str:
    return backend.push_source().role


def _rank(
    rank: int,
    world: int,
    port: int,
    parallel: dict,
    modes: tuple[str, ...],
    model_dir: str,
    out: str,
    barrier: Any,
    results: Any,
) -> None:
    """Each of `modes` ("full": every loss, "few": GSPO and cross entropy, "lora": LoRA) on one backend after
    the other, on the same process group (megatron's groups are made once for the layout)."""
    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.train.megatron.cpu import run_on_cpu

    try:
        run_on_cpu()
        join_gloo(rank, world, port)
        context = parallel.get("context", 1)
        for mode in modes:
            backend = MegatronBackend(
                model_dir, train_mode="lora" if mode == "lora" else "full", device="cpu",
                dtype=torch.float32, dist=DistContext(rank, world), parallel=parallel,
                max_tokens_per_micro_batch=MICRO_BATCH_TOKENS,
            )  # fmt: skip
            if mode == "lora":
                got = _run_lora(backend, FEW_LOSSES)
                if barrier is not None:
                    got.update(_lora_state_across_layouts(backend, Path(out), context, barrier))
                results.put(((mode, world, rank), got))
                continue
            got = _run(backend, LOSSES if mode == "full" else FEW_LOSSES)
            got["role"] = _push_roles(backend)
            if barrier is not None:
                got.update(_full_state_across_layouts(backend, Path(out), context, barrier))
            kept = got if rank == 0 else {k: got.get(k) for k in ("role", "refused")}
            results.put(((mode, world, rank), kept))
    except BaseException as exc:
        results.put((("error", world, rank), {"error": repr(exc)}))
        raise


def _steps_after(backend: Any, data: list[Datum], key: str = "full") -> list[np.ndarray]:
    backend.forward_backward(key, data, "cross_entropy", {})
    backend.optim_step(key, ADAM)
    return backend.forward_backward(key, data, "cross_entropy", {}, forward_only=True).logprobs


def _full_state_across_layouts(backend: Any, out: Path, context: int, barrier: Any) -> dict[str, Any]:
    """Full fine-tuning state saved at this CP size: its own resume (exact, with the optimizer; and its
    weights with a fresh Adam), then the other CP size's checkpoint: with the optimizer refused (the
    distributed optimizer's shards are cut over data x context ranks) leaving the model as it was, and
    without it loaded, the weights exactly the file's."""
    from miles.errors import UserError

    data = _batch(backend.vocab_size)
    mine, other = out / f"cp{context}", out / f"cp{3 - context}"
    backend.save_state("full", mine, with_optimizer=True)
    continued = _steps_after(backend, data)  # the uninterrupted run's next step
    backend.load_state("full", mine, with_optimizer=True)
    resumed = _steps_after(backend, data)
    got: dict[str, Any] = {
        "resumed_exactly": all(np.array_equal(a, b) for a, b in zip(continued, resumed, strict=True)),
        "state_files": sorted(p.name for p in mine.iterdir()),
    }
    backend.load_state("full", mine, with_optimizer=False)
    got["fresh_adam"] = _steps_after(backend, data)
    barrier.wait(timeout=240)  # both layouts have saved
    before = {n: p.detach().clone() for n, p in backend.gpt.named_parameters()}
    try:
        backend.load_state("full", other, with_optimizer=True)
        got["refused"] = None
    except UserError as exc:
        got["refused"] = str(exc)
    got["kept"] = all(torch.equal(p, before[n]) for n, p in backend.gpt.named_parameters())
    backend.load_state("full", other, with_optimizer=False)
    got["loaded"] = {n: p.detach().numpy().copy() for n, p in backend.gpt.named_parameters()}
    got["crossed"] = _steps_after(backend, data)
    return got


def _lora_state_across_layouts(backend: Any, out: Path, context: int, barrier: Any) -> dict[str, Any]:
    """Adapter "a" saved with its optimizer at this CP size; the other CP size's checkpoint resumed into a
    new adapter, whose next step must equal the saving run's own next step."""
    data = _batch(backend.vocab_size)
    mine, other = out / f"lora-cp{context}", out / f"lora-cp{3 - context}"
    backend.save_state("a", mine, with_optimizer=True)
    got: dict[str, Any] = {"continued": _steps_after(backend, data, "a")}
    barrier.wait(timeout=240)
    backend.load_state("a-resumed", other, with_optimizer=True)
    got["resumed"] = _steps_after(backend, data, "a-resumed")
    return got


def run_layouts(
    model_dir: Path, out: Path, layouts: list[tuple[int, dict]], modes: tuple[str, ...], across: bool = False
) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Each (world, parallel) layout on its own gloo ranks, all at once, running `modes`; `across`: each
    saves its state and loads the other's (two layouts, CP 1 and CP 2). Results by (mode, world, rank)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(sum(world for world, _ in layouts)) if across else None
    ranks = []
    for world, parallel in layouts:
        port = pick_master_port("127.0.0.1")
        args = (world, port, parallel, modes, str(model_dir), str(out), barrier, results)
        ranks += [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    with running(ranks):
        outcome = {}
        for _ in range(len(ranks) * len(modes)):
            key, got = results.get(timeout=420)
            outcome[key] = got
            assert "error" not in got, outcome
    return outcome


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context of 2046 tokens: not a multiple of 2 x CP (the backend refused to start
    on it before), so a datum of the whole context is padded past it."""
    from miles.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(max_position_embeddings=2046)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-2046"), spec)


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """CP 1 (one rank) and CP 2 (two ranks) at once: full fine-tuning with every loss, then LoRA, each
    loading the other layout's state."""
    out = tmp_path_factory.mktemp("cp")
    layouts = [(1, {}), (2, {"context": 2})]
    return run_layouts(model_dir, out, layouts, ("full", "lora"), across=True), out


@pytest.fixture(scope="module")
def reference(runs: tuple[dict, Path]) -> dict[str, Any]:
    return runs[0][("full", 1, 0)]


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


def test_context_parallel_2_trains_exactly_as_context_1(runs: tuple[dict, Path]) -> None:
    assert sorted(name for name, _ in LOSSES) == sorted(LOSS_NAMES)
    outcome, _ = runs
    assert_same_training(outcome[("full", 2, 0)], outcome[("full", 1, 0)], LOSSES, compare_grads=True)
    # the CP ranks hold the same weights: only CP rank 0 sends, and the state keeps one weights file
    assert [outcome[("full", 2, r)]["role"] for r in (0, 1)] == ["sender", "idle"]
    for world in (1, 2):
        assert outcome[("full", world, 0)]["resumed_exactly"], world
    assert outcome[("full", 2, 0)]["state_files"] == [
        "miles_state.json",
        "optimizer-tp0-cp0-dp0",
        "optimizer-tp0-cp1-dp0",
        "weights-tp0.safetensors",
    ]


def test_full_state_loads_across_context_sizes_without_its_optimizer(runs: tuple[dict, Path]) -> None:
    outcome, out = runs
    for context, other in ((1, 2), (2, 1)):
        got = outcome[("full", context, 0)]
        saved = load_file(str(out / f"cp{other}" / "weights-tp0.safetensors"))
        assert got["loaded"].keys() == saved.keys()
        assert all(np.array_equal(got["loaded"][n], t.numpy()) for n, t in saved.items()), context
        # the next step (a fresh Adam) equals the saving layout's own from the same file
        want = outcome[("full", other, 0)]["fresh_adam"]
        _close(got["crossed"], want, f"CP {context} from CP {other}'s state")


def test_full_state_with_its_optimizer_is_refused_at_another_context_size_on_every_rank(
    runs: tuple[dict, Path],
) -> None:
    outcome, _ = runs
    full = {(context, rank): got for (mode, context, rank), got in outcome.items() if mode == "full"}
    assert len(full) == 3
    for (context, rank), got in full.items():
        other = 3 - context
        refusal = got["refused"]
        assert refusal is not None, (context, rank)
        # names the layout saved, the one running, and both fixes
        assert f"context {other}, data 1); this trainer runs" in refusal, refusal
        assert f"context {context}, data 1):" in refusal, refusal
        assert f"model.parallel context={other} data=1" in refusal and "without the optimizer" in refusal
        if rank == 0:
            assert got["kept"], context


def test_context_parallel_2_with_tensor_parallel_2_and_sequence_parallel(
    reference: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    parallel = {"context": 2, "tensor": 2, "sequence_parallel": True}
    outcome = run_layouts(model_dir, tmp_path, [(4, parallel)], ("few",))
    assert_same_training(outcome[("few", 4, 0)], reference, FEW_LOSSES, compare_grads=False)
    # ranks: TP fastest, then CP; only the first CP rank's TP group takes part in the push
    assert [outcome[("few", 4, r)]["role"] for r in range(4)] == ["sender", "gatherer", "idle", "idle"]


def test_a_lora_adapter_at_context_parallel_2_trains_as_at_context_1(runs: tuple[dict, Path]) -> None:
    outcome, _ = runs
    got, lora_reference = outcome[("lora", 2, 0)], outcome[("lora", 1, 0)]
    for loss, _ in FEW_LOSSES:
        _close(got[loss]["logprobs"], lora_reference[loss]["logprobs"], f"{loss} logprobs")
        _close(got[loss]["loss"], lora_reference[loss]["loss"], f"{loss} elementwise loss")
        assert got[loss]["grads"].keys() == lora_reference[loss]["grads"].keys()
        for name, grad in lora_reference[loss]["grads"].items():
            np.testing.assert_allclose(got[loss]["grads"][name], grad, atol=TOL, rtol=TOL, err_msg=name)
    assert got["norm"] == pytest.approx(lora_reference["norm"], rel=1e-5)
    _close(got["after"], lora_reference["after"], "logprobs after the step")
    assert got["longest"][0].shape == (2046,)
    _close(got["longest"], lora_reference["longest"], "a datum of the model's whole context")


def test_a_lora_checkpoint_resumes_with_its_optimizer_across_context_sizes(runs: tuple[dict, Path]) -> None:
    outcome, _ = runs
    for context, other in ((1, 2), (2, 1)):
        resumed, continued = (
            outcome[("lora", context, 0)]["resumed"],
            outcome[("lora", other, 0)]["continued"],
        )
        _close(resumed, continued, f"LoRA CP {context} resuming CP {other}'s checkpoint")
