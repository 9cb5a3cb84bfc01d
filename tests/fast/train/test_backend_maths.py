"""Training maths of TransformersBackend against a plain torch reference on the same HF weights.

The reference runs each datum unpadded through a separately loaded HF model, applies the loss formulas
written out here, and back-propagates; LoRA is expressed as W + (alpha/r)·B·A through
torch.func.functional_call, so peft is not part of the reference. tests/gpu/ re-runs this module on CUDA
(fp32 and bf16) by overriding the `env` fixture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.func import functional_call
from transformers import AutoModelForCausalLM

from miles.errors import UserError
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

VOCAB = 1024
LORA_SPEC = LoraSpec(rank=4, alpha=8.0, seed=3)
PPO_CONFIG = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
# Configs under which each loss takes both branches of its clip on make_batch's data.
LOSS_CONFIGS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "soft_cross_entropy": {},
    "importance_sampling": {},
    "ppo": PPO_CONFIG,
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
    "stable_reinforce": {"kl_coeff": 0.7},
}
SOFT_K = 3


@dataclass(frozen=True)
class TrainEnv:
    device: str
    dtype: torch.dtype
    atol: float
    rtol: float


@pytest.fixture(scope="module")
def env() -> TrainEnv:
    return TrainEnv("cpu", torch.float32, 1e-5, 1e-5)


def make_batch(loss_fn: str, seed: int = 0, lengths: tuple[int, ...] = (5, 9, 7)) -> list[Datum]:
    """Random tokens; old logprobs near the model's so ppo both clips and does not clip."""
    rng = np.random.default_rng(seed)
    batch = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int64)
        inputs: dict[str, np.ndarray] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0.0, 1.0, n).astype(np.float32)
        elif loss_fn == "soft_cross_entropy":  # (N, K) targets, e.g. a teacher's top-K, with signed weights
            inputs["target_tokens"] = rng.integers(0, VOCAB, (n, SOFT_K)).astype(np.int64)
            inputs["weights"] = rng.uniform(-0.5, 1.0, (n, SOFT_K)).astype(np.float32)
        else:
            inputs["logprobs"] = (-np.log(VOCAB) + rng.normal(0.0, 0.2, n)).astype(np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
            if loss_fn == "gspo" and len(batch) != 1:  # datum 1 has no mask: its ratio spans every token
                inputs["sequence_ratio_mask"] = (np.arange(n) >= n // 3).astype(np.float32)
        batch.append(Datum(tokens[:-1], inputs))
    return batch


def reference_elementwise(lp: torch.Tensor, datum: Datum, loss_fn: str, config: dict) -> torch.Tensor:
    """The losses as docs/training.md writes them (Tinker's definitions), independently of miles.train."""
    inputs = {k: torch.as_tensor(v, device=lp.device).float() for k, v in datum.loss_fn_inputs.items()}
    if loss_fn in ("cross_entropy", "soft_cross_entropy"):
        per_target = -(inputs["weights"] * lp)
        return per_target.sum(-1) if per_target.dim() == 2 else per_target
    old, adv = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -(ratio * adv)
    if loss_fn == "cispo":
        weight = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
        return -(weight * lp * adv)
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - old) ** 2)
    if loss_fn == "stable_reinforce":
        return -(ratio * adv) + config["kl_coeff"] * (ratio - 1 - torch.log(ratio))
    if loss_fn == "gspo":
        mask = inputs.get("sequence_ratio_mask", torch.ones_like(lp))
        seq_log_ratio = ((lp.detach() - old) * mask).sum() / mask.sum()
        ratio = torch.exp(seq_log_ratio) * torch.exp(lp) / torch.exp(lp).detach()
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def reference_run(model, overrides, batch, loss_fn, config):
    """Per datum, unpadded: logprobs, elementwise loss; returns the summed loss too."""
    lps, els, total = [], [], 0.0
    for datum in batch:
        device = next(model.parameters()).device
        ids = torch.as_tensor(datum.model_input, device=device)[None]
        out = functional_call(model, overrides, args=(ids,), kwargs={"use_cache": False})
        logits = out.logits.float()[0]
        targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"], device=device)
        logp_all = torch.log_softmax(logits, -1)
        lp = (
            logp_all.gather(-1, targets)
            if targets.dim() == 2
            else logp_all.gather(-1, targets[:, None])[:, 0]
        )
        el = reference_elementwise(lp, datum, loss_fn, config)
        lps.append(lp)
        els.append(el)
        total = total + el.sum()
    return lps, els, total


def lora_overrides(ref_model, adapter: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    base = dict(ref_model.named_parameters())
    overrides = {}
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        weight = base[f"{module}.weight"]  # peft keeps adapters in fp32 on a bf16 base
        overrides[f"{module}.weight"] = weight + (scale * (b @ a)).to(weight.dtype)
    return overrides


def close(actual, expected, env: TrainEnv, what: str) -> None:
    actual = torch.as_tensor(actual).detach().float().cpu()
    expected = torch.as_tensor(expected).detach().float().cpu()
    torch.testing.assert_close(actual, expected, atol=env.atol, rtol=env.rtol, msg=lambda m: f"{what}: {m}")


def new_backend(model_dir: Path, env: TrainEnv, mode: str, **kw) -> TransformersBackend:
    return TransformersBackend(str(model_dir), train_mode=mode, device=env.device, dtype=env.dtype, **kw)


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir: Path, env: TrainEnv):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=env.dtype).to(env.device)
    return model.eval()


def snapshot(backend: TransformersBackend, key: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.named_trainable_parameters(key)}


def grads(backend: TransformersBackend, key: str) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in backend.named_trainable_parameters(key)}


@pytest.mark.parametrize("loss_fn", list(LOSS_CONFIGS))
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_loss_value_and_gradients_match_reference(tiny_model_dir, env, ref_model, mode, loss_fn) -> None:
    # a small micro-batch budget makes the backend pad and split, the reference never does
    backend = new_backend(tiny_model_dir, env, mode, max_tokens_per_micro_batch=20)
    key = "m"
    if mode == "lora":
        backend.create_adapter(key, LORA_SPEC)
        # one step first, so B != 0 and A's gradient is not trivially zero
        backend.forward_backward(key, make_batch("cross_entropy", seed=9), "cross_entropy", {})
        backend.optim_step(key, AdamParams(learning_rate=1e-2))
    config = LOSS_CONFIGS[loss_fn]
    batch = make_batch(loss_fn)
    wire_loss = "cross_entropy" if loss_fn == "soft_cross_entropy" else loss_fn
    out = backend.forward_backward(key, batch, wire_loss, config)

    if mode == "lora":
        leaves = {n: p.detach().clone().requires_grad_(True) for n, p in snapshot(backend, key).items()}
        overrides = lora_overrides(ref_model, leaves, LORA_SPEC.alpha / LORA_SPEC.rank)
    else:
        leaves = {n: p.detach().clone().requires_grad_(True) for n, p in ref_model.named_parameters()}
        overrides = leaves
    lps, els, total = reference_run(ref_model, overrides, batch, loss_fn, config)
    total.backward()

    assert len(out.logprobs) == len(batch)
    for i, datum in enumerate(batch):
        assert out.logprobs[i].shape == datum.loss_fn_inputs["target_tokens"].shape
        assert out.elementwise_loss[i].shape == (len(datum.model_input),)
        close(out.logprobs[i], lps[i], env, f"logprobs of datum {i}")
        close(out.elementwise_loss[i], els[i], env, f"elementwise loss of datum {i}")
    close(out.metrics["loss:sum"], total, env, "loss:sum")
    if loss_fn in ("ppo", "cispo", "gspo"):  # the batch really exercises both branches of the clip
        ratios = np.array(branch_ratios(loss_fn, out.logprobs, batch))
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        assert ((ratios > high) | (ratios < low)).any(), ratios
        assert ((ratios > low) & (ratios < high)).any(), ratios
    got = grads(backend, key)
    assert set(got) == set(leaves)
    for name, leaf in leaves.items():
        expected = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        assert got[name] is not None, name
        close(got[name], expected, env, f"gradient of {name}")
    reference_norm = torch.sqrt(sum((leaf.grad.float() ** 2).sum() for leaf in leaves.values()))
    metrics = backend.optim_step(key, AdamParams(learning_rate=1e-3))
    close(metrics["grad_norm:mean"], reference_norm, env, "grad_norm")


def branch_ratios(loss_fn: str, logprobs: list[np.ndarray], batch: list[Datum]) -> list[float]:
    """The ratios a clipping loss clips: per token, or (gspo) one per datum."""
    ratios: list[float] = []
    for lp, datum in zip(logprobs, batch, strict=True):
        log_ratio = lp - datum.loss_fn_inputs["logprobs"]
        if loss_fn != "gspo":
            ratios.extend(np.exp(log_ratio))
            continue
        mask = datum.loss_fn_inputs.get("sequence_ratio_mask", np.ones_like(lp))
        ratios.append(float(np.exp((log_ratio * mask).sum() / mask.sum())))
    return ratios


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_forward_only_changes_neither_weights_nor_gradients(tiny_model_dir, env, mode) -> None:
    backend = new_backend(tiny_model_dir, env, mode)
    if mode == "lora":
        backend.create_adapter("m", LORA_SPEC)
    batch = make_batch("cross_entropy")
    trained = backend.forward_backward("m", batch[:1], "cross_entropy", {})
    weights, grads_before = snapshot(backend, "m"), grads(backend, "m")
    out = backend.forward_backward("m", batch, "cross_entropy", {}, forward_only=True)
    for name, value in snapshot(backend, "m").items():
        assert torch.equal(value, weights[name]), name
    for name, value in grads(backend, "m").items():
        before = grads_before[name]
        assert (value is None and before is None) or torch.equal(value, before), name
    close(out.logprobs[0], trained.logprobs[0], env, "forward_only logprobs")


def test_gradients_accumulate_across_chunks_until_optim_step(tiny_model_dir, env) -> None:
    whole, chunked = (new_backend(tiny_model_dir, env, "full") for _ in range(2))
    batch = make_batch("importance_sampling")
    whole.forward_backward("m", batch, "importance_sampling", {})
    chunked.forward_backward("m", batch[:2], "importance_sampling", {})
    chunked.forward_backward("m", batch[2:], "importance_sampling", {})
    expected = grads(whole, "m")
    for name, grad in grads(chunked, "m").items():
        close(grad, expected[name], env, f"accumulated gradient of {name}")
    chunked.optim_step("m", AdamParams(learning_rate=1e-3))
    assert all(g is None for g in grads(chunked, "m").values())


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_overfitting_one_datum_lowers_the_loss(tiny_model_dir, env, mode) -> None:
    backend = new_backend(tiny_model_dir, env, mode)
    if mode == "lora":
        backend.create_adapter("m", LORA_SPEC)
    datum = make_batch("cross_entropy", lengths=(8,))
    losses = []
    for _ in range(8):
        losses.append(backend.forward_backward("m", datum, "cross_entropy", {}).metrics["loss:sum"])
        backend.optim_step("m", AdamParams(learning_rate=2e-2, grad_clip_norm=1.0))
    assert losses[-1] < 0.5 * losses[0], losses


def train_steps(backend: TransformersBackend, key: str, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        batch = make_batch("ppo", seed=seed + step)
        backend.forward_backward(key, batch, "ppo", PPO_CONFIG)
        backend.optim_step(key, AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_save_load_round_trip_resumes_optimizer(tiny_model_dir, env, mode, tmp_path) -> None:
    original = new_backend(tiny_model_dir, env, mode)
    if mode == "lora":
        original.create_adapter("m", LORA_SPEC)
    train_steps(original, "m", 2)
    original.save_state("m", tmp_path / "ckpt", with_optimizer=True)
    probe = make_batch("cross_entropy", seed=42)
    before = original.forward_backward("m", probe, "cross_entropy", {}, forward_only=True)

    restored = new_backend(tiny_model_dir, env, mode)
    restored.load_state("other-key", tmp_path / "ckpt", with_optimizer=True)  # LoRA: created from the spec
    after = restored.forward_backward("other-key", probe, "cross_entropy", {}, forward_only=True)
    for a, b in zip(after.logprobs, before.logprobs, strict=True):
        assert np.array_equal(a, b)

    train_steps(original, "m", 1, seed=100)
    train_steps(restored, "other-key", 1, seed=100)
    expected = snapshot(original, "m")
    for name, value in snapshot(restored, "other-key").items():
        close(value, expected[name], env, f"{name} one step after load")

    # without the optimizer the next step starts Adam afresh, so it differs from the resumed one
    fresh = new_backend(tiny_model_dir, env, mode)
    fresh.load_state("m", tmp_path / "ckpt", with_optimizer=False)
    train_steps(fresh, "m", 1, seed=100)
    assert any(not torch.allclose(v, expected[n]) for n, v in snapshot(fresh, "m").items())


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_state_saved_before_any_step_loads_with_an_empty_optimizer(
    tiny_model_dir, env, mode, tmp_path
) -> None:
    original = new_backend(tiny_model_dir, env, mode)
    if mode == "lora":
        original.create_adapter("m", LORA_SPEC)
    original.forward_backward("m", make_batch("cross_entropy", seed=3), "cross_entropy", {})  # no step yet
    original.save_state("m", tmp_path / "first", with_optimizer=True)
    restored = new_backend(tiny_model_dir, env, mode)
    restored.load_state("m", tmp_path / "first", with_optimizer=True)
    assert all(g is None for g in grads(restored, "m").values())  # pending gradients are not state
    # both now start Adam from nothing: the same steps give the same weights
    original.reset("m")
    train_steps(original, "m", 2, seed=11)
    train_steps(restored, "m", 2, seed=11)
    expected = snapshot(original, "m")
    for name, value in snapshot(restored, "m").items():
        close(value, expected[name], env, f"{name} two steps after loading an empty optimizer")


def test_loading_optimizer_from_a_weights_only_checkpoint_is_refused(tiny_model_dir, env, tmp_path) -> None:
    backend = new_backend(tiny_model_dir, env, "lora")
    backend.create_adapter("m", LORA_SPEC)
    backend.save_state("m", tmp_path / "w", with_optimizer=False)
    with pytest.raises(UserError, match="without optimizer"):
        backend.load_state("m", tmp_path / "w", with_optimizer=True)
    with pytest.raises(UserError, match="not a trainer checkpoint"):
        backend.load_state("m", tmp_path, with_optimizer=False)
    # a checkpoint of another rank into an existing model: the caller's mistake, not a trainer failure
    backend.create_adapter("other-rank", replace(LORA_SPEC, rank=LORA_SPEC.rank * 2))
    with pytest.raises(UserError, match="different modules or rank"):
        backend.load_state("other-rank", tmp_path / "w", with_optimizer=False)


def test_named_adapters_on_one_base_are_independent(tiny_model_dir, env) -> None:
    backend = new_backend(tiny_model_dir, env, "lora")
    backend.create_adapter("tenant-a", LORA_SPEC)
    backend.create_adapter("tenant-b", replace(LORA_SPEC, rank=2, train_mlp=False))
    probe = make_batch("cross_entropy", seed=5)
    b_before = backend.forward_backward("tenant-b", probe, "cross_entropy", {}, forward_only=True)
    b_weights = snapshot(backend, "tenant-b")

    train_steps(backend, "tenant-a", 2)
    backend.forward_backward("tenant-a", probe, "cross_entropy", {})  # pending grads on A only
    assert all(g is None for g in grads(backend, "tenant-b").values())
    b_after = backend.forward_backward("tenant-b", probe, "cross_entropy", {}, forward_only=True)
    a_after = backend.forward_backward("tenant-a", probe, "cross_entropy", {}, forward_only=True)
    for name, value in snapshot(backend, "tenant-b").items():
        assert torch.equal(value, b_weights[name]), name
    for before, after, a in zip(b_before.logprobs, b_after.logprobs, a_after.logprobs, strict=True):
        assert np.array_equal(before, after)
        assert not np.allclose(a, after)  # A trained, B did not

    backend.remove_adapter("tenant-a")
    assert not backend.has_adapter("tenant-a") and backend.has_adapter("tenant-b")
    again = backend.forward_backward("tenant-b", probe, "cross_entropy", {}, forward_only=True)
    assert np.array_equal(again.logprobs[0], b_before.logprobs[0])
    with pytest.raises(UserError, match="no LoRA adapter 'tenant-a'"):
        backend.forward_backward("tenant-a", probe, "cross_entropy", {})


@pytest.mark.parametrize(
    ("flags", "expected_modules"),
    [
        ({"train_mlp": False, "train_unembed": False}, {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ({"train_attn": False, "train_unembed": False}, {"gate_proj", "up_proj", "down_proj"}),
        ({"train_attn": False, "train_mlp": False}, {"lm_head"}),
    ],
)
def test_train_attn_mlp_unembed_select_the_lora_targets(tiny_model_dir, env, flags, expected_modules) -> None:
    backend = new_backend(tiny_model_dir, env, "lora")
    backend.create_adapter("m", replace(LORA_SPEC, **flags))
    modules = {
        name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in backend.named_trainable_parameters("m")
    }
    assert modules == expected_modules
    backend.forward_backward("m", make_batch("cross_entropy"), "cross_entropy", {})
    assert all(p.grad is not None for _, p in backend.named_trainable_parameters("m"))


def test_bad_lora_specs_and_full_mode_adapters_are_refused(tiny_model_dir, env) -> None:
    lora = new_backend(tiny_model_dir, env, "lora")
    with pytest.raises(UserError, match="at least one of train_attn"):
        lora.create_adapter("m", LoraSpec(train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(UserError, match="rank must be a positive integer"):
        lora.create_adapter("m", LoraSpec(rank=0))
    lora.create_adapter("m", LORA_SPEC)
    with pytest.raises(UserError, match="already exists"):
        lora.create_adapter("m", LORA_SPEC)
    full = new_backend(tiny_model_dir, env, "full")
    with pytest.raises(UserError, match="needs a LoRA trainer"):
        full.create_adapter("m", LORA_SPEC)
    with pytest.raises(UserError, match="train_mode must be"):
        new_backend(tiny_model_dir, env, "qlora")


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_reset_restores_initial_weights_and_a_fresh_optimizer(tiny_model_dir, env, mode) -> None:
    backend, fresh = new_backend(tiny_model_dir, env, mode), new_backend(tiny_model_dir, env, mode)
    for b in (backend, fresh):
        if mode == "lora":
            b.create_adapter("m", LORA_SPEC)
    initial = snapshot(backend, "m")
    train_steps(backend, "m", 2)
    backend.forward_backward("m", make_batch("cross_entropy"), "cross_entropy", {})
    backend.reset("m")
    for name, value in snapshot(backend, "m").items():
        assert torch.equal(value, initial[name]), name
    assert all(g is None for g in grads(backend, "m").values())
    train_steps(backend, "m", 1)
    train_steps(fresh, "m", 1)
    expected = snapshot(fresh, "m")
    for name, value in snapshot(backend, "m").items():
        close(value, expected[name], env, f"{name} after reset + 1 step")


def test_exported_adapter_loads_with_peft_and_gives_the_same_logprobs(tiny_model_dir, env, tmp_path) -> None:
    from peft import PeftModel

    backend = new_backend(tiny_model_dir, env, "lora")
    backend.create_adapter("tinker:train:0", LORA_SPEC)
    train_steps(backend, "tinker:train:0", 2)
    backend.export_adapter("tinker:train:0", tmp_path / "peft")
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=env.dtype).to(env.device)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    probe = make_batch("cross_entropy", seed=7)
    ours = backend.forward_backward("tinker:train:0", probe, "cross_entropy", {}, forward_only=True)
    with torch.no_grad():
        lps, _, _ = reference_run(loaded, {}, probe, "cross_entropy", {})
    for a, b in zip(ours.logprobs, lps, strict=True):
        close(a, b, env, "logprobs through the exported adapter")


def test_full_export_and_iter_hf_weights_use_hf_names(tiny_model_dir, env, tmp_path) -> None:
    from transformers import AutoTokenizer

    backend = new_backend(tiny_model_dir, env, "full")
    train_steps(backend, "full", 1)
    backend.export_hf_weights(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=env.dtype).to(env.device)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token == "<|im_end|>"
    pushed = dict(backend.iter_hf_weights())
    assert set(pushed) == set(loaded.state_dict())
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, pushed[name]), name
    trained = snapshot(backend, "full")
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], load_original(tiny_model_dir, env))

    lora = new_backend(tiny_model_dir, env, "lora")
    lora.create_adapter("m", LORA_SPEC)
    base_names = set(dict(lora.iter_hf_weights()))
    assert base_names == set(loaded.state_dict())
    with pytest.raises(UserError, match="LoRA trainers export adapters"):
        lora.export_hf_weights(tmp_path / "nope")


def load_original(model_dir: Path, env: TrainEnv) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=env.dtype).to(env.device)
    return model.state_dict()["model.layers.0.mlp.up_proj.weight"]


def test_bad_batches_and_adam_params_are_user_errors(tiny_model_dir, env) -> None:
    backend = new_backend(tiny_model_dir, env, "full")
    bad = make_batch("ppo")
    del bad[1].loss_fn_inputs["advantages"]
    with pytest.raises(UserError, match="datum 1"):
        backend.forward_backward("m", bad, "ppo", {})
    assert all(g is None for g in grads(backend, "m").values())
    with pytest.raises(UserError, match="supported losses: cross_entropy, importance_sampling, ppo, cispo"):
        backend.forward_backward("m", make_batch("ppo"), "grpo", {})
    with pytest.raises(UserError, match="learning_rate"):
        backend.optim_step("m", AdamParams(learning_rate=-1.0))
