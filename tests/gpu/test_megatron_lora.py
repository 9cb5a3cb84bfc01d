"""LoRA on the megatron backend at TP=1 on one GPU against the transformers backend's same adapter.

Claims: with the transformers backend's adapter copied across (B made non-zero, so every tensor has a
gradient), logprobs, losses and the gradients in PEFT names equal (fp32 tight, bf16 within bf16
tolerance); LoRA steps lower the loss; save/load resumes bit-exactly, and the transformers backend loads the
same checkpoint; the exported adapter, loaded by the CPU engine on CUDA, gives the trainer's logprobs.
One process holds one set of megatron parallel groups, so this module's backends share them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs the gpu extra (megatron-core)")

from miles.models.tiny import TinyModelSpec, build_tiny_model
from miles.train.backends.megatron_backend import MegatronBackend
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

pytestmark = pytest.mark.gpu
SMALL = TinyModelSpec(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    intermediate_size=512, seed=3,
)  # fmt: skip
SPEC = LoraSpec(rank=8, seed=11)  # attention, MLP and unembedding
KEY = "tenant-a"
DEVICE = "cuda"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-qwen3-lora"), SMALL)


def batch(seed: int, lengths: tuple[int, ...] = (17, 33, 9, 24)) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, SMALL.vocab_size, n + 1).astype(np.int64)
        weights = rng.uniform(0.0, 1.0, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def pair(model: Path, dtype: torch.dtype) -> tuple[TransformersBackend, MegatronBackend]:
    """Both backends holding the same adapter: the transformers one's, with B made non-zero."""
    hf = TransformersBackend(str(model), train_mode="lora", device=DEVICE, dtype=dtype, compile_layers=False)
    hf.create_adapter(KEY, SPEC)
    adapter = hf.lora.get(KEY)
    generator = torch.Generator().manual_seed(0)
    state = {
        name: t + 0.02 * torch.randn(t.shape, generator=generator).to(t) if ".lora_B." in name else t
        for name, t in hf.lora.state_dict(adapter).items()
    }
    hf.lora.load_state_dict(adapter, state)
    mc = MegatronBackend(str(model), train_mode="lora", device=DEVICE, dtype=dtype)
    mc.create_adapter(KEY, SPEC)
    mc.lora.adapters.load_hf(mc.lora.adapters.get(KEY), state)
    return hf, mc


@pytest.fixture(scope="module")
def fp32_pair(small_model: Path) -> tuple[TransformersBackend, MegatronBackend]:
    return pair(small_model, torch.float32)


def peft_grads(hf: TransformersBackend) -> dict[str, torch.Tensor]:
    return {name: p.grad.float() for name, p in hf.named_trainable_parameters(KEY)}


def assert_same_gradients(got: dict, want: dict, tolerance: float) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        scale = float(ref.abs().max()) + 1e-6
        assert float((got[name].float().to(ref.device) - ref).abs().max()) / scale < tolerance, name


def test_fp32_logprobs_losses_and_gradients_equal_the_transformers_adapter(fp32_pair) -> None:
    hf, mc = fp32_pair
    data = batch(seed=1)
    want = hf.forward_backward(KEY, data, "cross_entropy", {})
    got = mc.forward_backward(KEY, data, "cross_entropy", {})
    np.testing.assert_allclose(flat(got.logprobs), flat(want.logprobs), atol=2e-4, rtol=0)
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-4)
    assert_same_gradients(mc.lora.hf_gradients(KEY), peft_grads(hf), 2e-3)
    norms = (
        mc.optim_step(KEY, AdamParams(learning_rate=1e-3)),
        hf.optim_step(KEY, AdamParams(learning_rate=1e-3)),
    )
    assert norms[0]["grad_norm:mean"] == pytest.approx(norms[1]["grad_norm:mean"], rel=1e-4)
    after = [b.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True) for b in (mc, hf)]
    np.testing.assert_allclose(flat(after[0].logprobs), flat(after[1].logprobs), atol=5e-4, rtol=0)
    for backend in fp32_pair:
        backend.reset(KEY)


def test_bf16_logprobs_and_gradients_equal_within_bf16_tolerance(small_model: Path) -> None:
    hf, mc = pair(small_model, torch.bfloat16)
    data = batch(seed=2)
    want = hf.forward_backward(KEY, data, "cross_entropy", {})
    got = mc.forward_backward(KEY, data, "cross_entropy", {})
    diff = np.abs(flat(got.logprobs) - flat(want.logprobs))
    assert diff.mean() < 2e-2 and diff.max() < 0.15
    assert_same_gradients(mc.lora.hf_gradients(KEY), peft_grads(hf), 0.1)


def test_lora_steps_lower_the_loss_and_adapters_stay_apart(fp32_pair) -> None:
    _, mc = fp32_pair
    mc.create_adapter("tenant-b", LoraSpec(rank=4, train_unembed=False))
    data = batch(seed=4)
    base = flat(mc.forward_backward("tenant-b", data, "cross_entropy", {}, forward_only=True).logprobs)
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    losses = []
    for _ in range(8):
        losses.append(mc.forward_backward(KEY, data, "cross_entropy", {}).metrics["loss:sum"])
        assert mc.optim_step(KEY, adam)["grad_norm:mean"] > 0
    assert losses[-1] < 0.8 * losses[0], losses
    untouched = flat(mc.forward_backward("tenant-b", data, "cross_entropy", {}, forward_only=True).logprobs)
    assert np.array_equal(untouched, base)  # a fresh adapter (B = 0) is the base model, and stays so
    assert sorted(mc.model_keys()) == ["tenant-a", "tenant-b"]
    mc.remove_adapter("tenant-b")
    mc.reset(KEY)


@sdpa_kernel(SDPBackend.MATH)  # the fused attention backward kernels accumulate in a varying order
def test_save_and_load_resume_bit_exactly(fp32_pair, tmp_path: Path) -> None:
    hf, mc = fp32_pair
    data, probe = batch(seed=5), batch(seed=6)
    adam = AdamParams(learning_rate=1e-3)

    def train_step() -> None:
        mc.forward_backward(KEY, data, "cross_entropy", {})
        mc.optim_step(KEY, adam)

    train_step()
    mc.save_state(KEY, tmp_path / "ckpt", with_optimizer=True)
    saved = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    train_step()
    expected = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    mc.load_state(KEY, tmp_path / "ckpt", with_optimizer=True)
    train_step()
    resumed = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    assert np.array_equal(resumed, expected)
    mc.load_state("restored", tmp_path / "ckpt", with_optimizer=False)  # a new key, from the checkpoint
    restored = flat(mc.forward_backward("restored", probe, "cross_entropy", {}, forward_only=True).logprobs)
    assert np.array_equal(restored, saved)
    hf.load_state("from-megatron", tmp_path / "ckpt", with_optimizer=True)  # the same files as its own
    other = flat(hf.forward_backward("from-megatron", probe, "cross_entropy", {}, forward_only=True).logprobs)
    np.testing.assert_allclose(other, saved, atol=2e-4, rtol=0)
    for backend, key in ((mc, "restored"), (hf, "from-megatron")):
        backend.remove_adapter(key)
    mc.reset(KEY)


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 323, 846]


async def test_the_exported_adapter_gives_the_trainers_logprobs_on_the_engine(
    fp32_pair, small_model: Path, tmp_path: Path
) -> None:
    """The CPU engine (on CUDA) loads the exported PEFT directory as it loads a transformers-backend one."""
    from miles.engines.cpu.engine import Engine

    _, mc = fp32_pair
    tokens = np.array(PROMPT, dtype=np.int64)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(PROMPT) - 1, np.float32)})
    mc.forward_backward(KEY, [datum], "cross_entropy", {})
    mc.optim_step(KEY, AdamParams(learning_rate=1e-2))
    trained = mc.forward_backward(KEY, [datum], "cross_entropy", {}, forward_only=True).logprobs[0]
    mc.export_adapter(KEY, tmp_path / "adapter")
    engine = Engine(str(small_model))
    await engine.load()
    await engine.wait_loaded()
    try:
        await engine.load_adapter("a", str(tmp_path / "adapter"))
        logits = engine.model().forward(PROMPT, None, "a")[0]
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
        base = engine.model().forward(PROMPT, None, None)[0]
        assert not torch.allclose(logits, base, atol=1e-3), "the adapter should change the engine's logits"
        np.testing.assert_allclose(lp.numpy(), trained, atol=1e-3)
    finally:
        await engine.close()
    mc.reset(KEY)
