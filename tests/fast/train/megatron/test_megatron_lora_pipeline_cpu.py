"""LoRA through pipeline stages on CPU: the megatron backend at pipeline 2 (two gloo ranks, one layer of the
tiny model each) against the same backend at pipeline 1 (one rank), both running at once, in fp32.

Three adapters train interleaved over a few steps, each on its own batch in 3 micro-batches: "a" (rank 4,
every module), "b" (rank 2, no unembedding) and "c" (rank 3, the output layer only, so the first stage holds
none of it and only joins the collectives). Per step and adapter, pipeline 2 must equal pipeline 1 in the
logprobs, the loss, the whole adapter's gradients (rank 0 collects the stages'), the gradient norm
(all-reduced over the stages) and the weights after the AdamW step. Then each layout saves "a" and "c" with
their optimizer, exports "a" as a PEFT directory and "b" merged into the base; the files must be the same at
both layouts, and each layout resumes the other's checkpoints (pipeline 2 from pipeline 1's and back) to the
same next step.
Last, tenants share merged commands as the coalescer sends them (ForwardBackwardMany, OptimStepMany): at
pipeline 2 one tenant's bad batch and bad AdamW parameters fail that request alone, on both ranks, before any
collective; the other adapter's weights and pending gradients stay exactly as they were, and the other
tenants' results equal those of pipeline 1 running the same commands without the bad requests.

megatron-core 0.16.1 asks for CUDA in a few places: each rank redirects those to the CPU as
tools/megatron_cpu_check.py does. Skips without the gpu extra (CI installs it)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import pick_master_port
from miles.types import AdamParams, Datum, LoraSpec
from tests.fast.train.megatron.ranks import join_gloo, running

ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)  # the norms are above 1: the clipping matters
SPECS = {
    "a": LoraSpec(rank=4, seed=1),
    "b": LoraSpec(rank=2, seed=2, train_unembed=False),
    "c": LoraSpec(rank=3, seed=3, train_attn=False, train_mlp=False),
}
STEPS = 3
MICRO_BATCH_TOKENS = 24  # each batch runs as 3 micro-batches through the 1F1B schedule
TOLERANCE = 1e-5


def _batch(vocab: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (5, 9, 7, 12):
        tokens = rng.integers(0, vocab, n + 1)
        weights = rng.uniform(0, 1, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.detach().to("cpu").numpy().copy() for name, t in tensors.items()}


def _train(backend: Any, batches: dict[str, list[Datum]]) -> list[dict[str, Any]]:
    """STEPS rounds of forward_backward + optim_step for each adapter in turn: what rank 0 sees."""
    lora = backend.lora
    record = []
    for _ in range(STEPS):
        for key, data in batches.items():
            out = backend.forward_backward(key, data, "cross_entropy", {})
            grads = _numpy(lora.hf_gradients(key))  # a copy: at pipeline 1 they are views the step clips
            norm = backend.optim_step(key, ADAM)["grad_norm:mean"]
            weights = lora.adapters.hf_weights(lora.adapters.get(key))
            record.append(
                {
                    "key": key,
                    "logprobs": out.logprobs,
                    "loss": out.metrics["loss:sum"],
                    "grads": grads,
                    "norm": norm,
                    "weights": _numpy(weights),
                }
            )
    return record


def _next_step(backend: Any, key: str, data: list[Datum]) -> dict[str, Any]:
    out = backend.forward_backward(key, data, "cross_entropy", {})
    backend.optim_step(key, ADAM)
    weights = backend.lora.adapters.hf_weights(backend.lora.adapters.get(key))
    return {"logprobs": out.logprobs, "weights": _numpy(weights)}


def _tenants(backend: Any, batches: dict[str, list[Datum]], with_errors: bool) -> dict[str, Any]:
    """Adapter "a" has pending gradients while tenants "b" and "c" share merged commands, as the coalescer
    sends them; `with_errors`: "b"'s batch holds a token outside the vocabulary and its AdamW parameters are
    invalid, so it fails in both commands. "a"'s step must then equal the one taken without the errors."""
    from miles.train.coalescer import ForwardBackwardMany, OptimStepMany
    from miles.train.commands import ForwardBackward, OptimStep

    lora = backend.lora
    backend.forward_backward("a", batches["a"], "cross_entropy", {})
    adapter = lora.adapters.get("a")
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in adapter.named_parameters()}
    forwards = [ForwardBackward("c", batches["c"], "cross_entropy", {})]
    steps = [OptimStep("a", ADAM)]
    if with_errors:
        bad = list(batches["b"])
        tokens = bad[1].model_input.copy()
        tokens[3] = backend.vocab_size
        bad[1] = Datum(tokens, bad[1].loss_fn_inputs)
        forwards.insert(0, ForwardBackward("b", bad, "cross_entropy", {}))
        steps.insert(0, OptimStep("b", AdamParams(learning_rate=-1.0)))
    forwarded = ForwardBackwardMany(tuple(forwards)).run(backend)
    unchanged = all(
        torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1])
        for n, p in adapter.named_parameters()
    )
    stepped = OptimStepMany(tuple(steps)).run(backend)
    return {
        "errors": [str(o) for o in forwarded + stepped if isinstance(o, Exception)],
        "unchanged": unchanged,
        "c_logprobs": forwarded[-1].logprobs,
        "a_weights": _numpy(lora.adapters.hf_weights(adapter)),
    }


def _load_a_narrow_adapter(backend: Any, mine: Path) -> dict[str, Any]:
    """ "a"'s checkpoint with one B of the last layer (the last stage's) cut to rank 1: every rank must refuse
    it alike, and "a" keep its weights (before the shape check the last stage broadcast it in, silently)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    bad = mine / "state-a-narrow"
    if dist.get_rank() == 0:
        bad.mkdir()
        for item in (mine / "state-a").iterdir():
            (bad / item.name).write_bytes(item.read_bytes())
        tensors = load_file(str(bad / "weights.safetensors"))
        name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        tensors[name] = tensors[name][:, :1].contiguous()
        save_file(tensors, str(bad / "weights.safetensors"))
    dist.barrier()
    adapter = backend.lora.adapters.get("a")
    before = [p.detach().clone() for p in adapter.parameters()]
    try:
        backend.load_state("a", bad, with_optimizer=True)
        error = None
    except Exception as exc:  # the UserError the caller sees
        error = f"{type(exc).__name__}: {exc}"
    kept = all(torch.equal(p, q) for p, q in zip(adapter.parameters(), before, strict=True))
    return {"error": error, "kept": kept}


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, barrier: Any, results: Any) -> None:

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.train.megatron.cpu import run_on_cpu

    try:
        run_on_cpu()
        join_gloo(rank, world, port)
        backend = MegatronBackend(
            model_dir, train_mode="lora", device="cpu", dtype=torch.float32, dist=DistContext(rank, world),
            parallel={"pipeline": world}, max_tokens_per_micro_batch=MICRO_BATCH_TOKENS,
        )  # fmt: skip
        for key, spec in SPECS.items():
            backend.create_adapter(key, spec)
        weights = backend.lora.adapters.hf_weights
        got: dict[str, Any] = {"initial": {k: _numpy(weights(backend.lora.adapters.get(k))) for k in SPECS}}
        batches = {key: _batch(backend.vocab_size, seed) for seed, key in enumerate(SPECS)}
        mine, other = Path(out) / f"pp{world}", Path(out) / f"pp{3 - world}"
        got["steps"] = _train(backend, batches)
        for key in ("a", "c"):
            backend.save_state(key, mine / f"state-{key}", with_optimizer=True)
        backend.export_adapter("a", mine / "adapter-a")
        backend.export_merged_hf_weights("b", mine / "merged-b")
        got["continued"] = {key: _next_step(backend, key, batches[key]) for key in ("a", "c")}
        barrier.wait(timeout=240)  # both layouts have saved
        for key in ("a", "c"):
            backend.load_state(f"{key}-resumed", other / f"state-{key}", with_optimizer=True)
        resumed = {key: backend.lora.adapters.get(f"{key}-resumed") for key in ("a", "c")}
        got["loaded"] = {key: _numpy(backend.lora.adapters.hf_weights(a)) for key, a in resumed.items()}
        got["resumed"] = {key: _next_step(backend, f"{key}-resumed", batches[key]) for key in ("a", "c")}
        got["bad_file"] = _load_a_narrow_adapter(backend, mine)
        got["tenants"] = _tenants(backend, batches, with_errors=world == 2)
        backend.reset("b")
        got["reset_b"] = _numpy(weights(backend.lora.adapters.get("b")))
        results.put((world, rank, got))
    except BaseException as exc:
        results.put((world, rank, {"error": repr(exc)}))
        raise


def _run_both_layouts(model_dir: Path, out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(3)
    procs = []
    for world in (1, 2):
        port = pick_master_port("127.0.0.1")
        for rank in range(world):
            args = (rank, world, port, str(model_dir), str(out), barrier, results)
            procs.append(ctx.Process(target=_rank, args=args))
    with running(procs):
        outcome = {}
        for _ in procs:
            world, rank, got = results.get(timeout=300)
            outcome[(world, rank)] = got
    assert all("error" not in got for got in outcome.values()), outcome
    return outcome


def _close(ours: Any, theirs: Any, what: str) -> None:
    np.testing.assert_allclose(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE, err_msg=what)


def _same_tensors(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name in theirs:
        _close(np.asarray(ours[name]), np.asarray(theirs[name]), f"{what}: {name}")


def _same_files(ours: Path, theirs: Path, files: tuple[str, ...]) -> None:
    for name in files:
        _same_tensors(load_file(str(ours / name)), load_file(str(theirs / name)), f"{ours.name}/{name}")


def _adapter_config(directory: Path) -> dict:
    config = json.loads((directory / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"])  # peft writes a set: in hash order
    return config


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("lora-pipeline")
    return _run_both_layouts(tiny_model_dir, out), out


def test_both_layouts_create_the_same_adapters_and_reset_to_them(runs) -> None:
    outcome, _ = runs
    one, two = outcome[(1, 0)], outcome[(2, 0)]
    for key in SPECS:
        assert two["initial"][key].keys() == one["initial"][key].keys()
        assert all(np.array_equal(two["initial"][key][n], a) for n, a in one["initial"][key].items()), key
    for got in (one, two):
        assert all(np.array_equal(got["reset_b"][n], a) for n, a in got["initial"]["b"].items())


def test_pipeline_2_trains_interleaved_adapters_exactly_as_pipeline_1(runs) -> None:
    outcome, _ = runs
    one, two = outcome[(1, 0)]["steps"], outcome[(2, 0)]["steps"]
    assert [s["key"] for s in two] == [s["key"] for s in one] == list(SPECS) * STEPS
    for index, (ours, theirs) in enumerate(zip(two, one, strict=True)):
        what = f"step {index // len(SPECS)} adapter {theirs['key']}"
        for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True):
            _close(a, b, f"{what} logprobs")
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=TOLERANCE), what
        assert ours["norm"] == pytest.approx(theirs["norm"], rel=TOLERANCE), what
        _same_tensors(ours["grads"], theirs["grads"], f"{what} gradients")
        _same_tensors(ours["weights"], theirs["weights"], f"{what} weights")
    assert all(s["norm"] > ADAM.grad_clip_norm for s in one[len(SPECS) :])  # clipped after the first round
    first_b = next(s for s in one if s["key"] == "b")
    assert not any(".lm_head." in name for name in first_b["weights"])  # each adapter its own modules
    assert {n.split(".lora_")[0] for n in one[2]["weights"]} == {"base_model.model.lm_head"}
    # rank 1 (the second stage) answers the same results
    for a, b in zip(outcome[(2, 1)]["steps"][-1]["logprobs"], two[-1]["logprobs"], strict=True):
        assert np.array_equal(a, b)


def test_saved_and_exported_adapters_are_the_same_files_at_both_layouts(runs) -> None:
    _, out = runs
    for key in ("a", "c"):
        one, two = out / "pp1" / f"state-{key}", out / "pp2" / f"state-{key}"
        assert json.loads((two / "miles_state.json").read_text()) == json.loads(
            (one / "miles_state.json").read_text()
        )
        assert json.loads((two / "optimizer.json").read_text()) == json.loads(
            (one / "optimizer.json").read_text()
        )
        _same_files(two, one, ("weights.safetensors", "optimizer.safetensors"))
    one, two = out / "pp1" / "adapter-a", out / "pp2" / "adapter-a"
    assert _adapter_config(two) == _adapter_config(one)
    _same_files(two, one, ("adapter_model.safetensors",))
    exported = load_file(str(two / "adapter_model.safetensors"))
    layers = {name.split(".layers.")[1].split(".")[0] for name in exported if ".layers." in name}
    assert layers == {"0", "1"} and any(".lm_head." in name for name in exported)  # both stages' layers
    merged = sorted((out / "pp2" / "merged-b").glob("*.safetensors"))
    assert [p.name for p in merged] == [
        p.name for p in sorted((out / "pp1" / "merged-b").glob("*.safetensors"))
    ]
    for path in merged:
        _same_tensors(load_file(str(path)), load_file(str(out / "pp1" / "merged-b" / path.name)), path.name)


def test_each_layout_resumes_the_others_checkpoint(runs) -> None:
    outcome, out = runs
    for world, other in ((2, 1), (1, 2)):
        got = outcome[(world, 0)]
        for key in ("a", "c"):
            saved = load_file(str(out / f"pp{other}" / f"state-{key}" / "weights.safetensors"))
            loaded = got["loaded"][key]
            assert loaded.keys() == saved.keys()
            assert all(np.array_equal(loaded[n], saved[n].numpy()) for n in saved), (world, key)
            resumed, continued = got["resumed"][key], got["continued"][key]
            for a, b in zip(resumed["logprobs"], continued["logprobs"], strict=True):
                _close(a, b, f"pp{world} resuming {key}")
            _same_tensors(resumed["weights"], continued["weights"], f"pp{world} resuming {key}")


def test_an_adapter_file_of_the_wrong_rank_is_refused_on_every_stage(runs) -> None:
    outcome, _ = runs
    for (world, rank), got in outcome.items():
        refusal = got["bad_file"]
        assert refusal["error"] is not None, (world, rank)
        assert refusal["error"].startswith("UserError") and "rank-4" in refusal["error"], refusal
        assert refusal["kept"], (world, rank)


def test_a_bad_tenant_request_fails_on_every_stage_and_leaves_the_other_adapters_alone(runs) -> None:
    outcome, _ = runs
    for rank in (0, 1):
        got = outcome[(2, rank)]["tenants"]
        assert len(got["errors"]) == 2, got["errors"]
        assert "token ids outside" in got["errors"][0] and "learning_rate" in got["errors"][1]
        assert got["unchanged"]  # "a"'s weights and pending gradients, while "b" failed beside "c"
    clean = outcome[(1, 0)]["tenants"]
    assert clean["errors"] == []
    for rank in (0, 1):  # the tenants beside the failed one answer as in the run without the errors
        got = outcome[(2, rank)]["tenants"]
        for a, b in zip(got["c_logprobs"], clean["c_logprobs"], strict=True):
            _close(a, b, f"rank {rank}: c's logprobs")
    _same_tensors(outcome[(2, 0)]["tenants"]["a_weights"], clean["a_weights"], "a's step")
