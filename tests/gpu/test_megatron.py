"""The megatron backend at TP=1 on one GPU against the transformers backend, on a small Qwen3 shape.

Claims: logprobs equal (fp32 tight, bf16 within bf16 tolerance); the losses' values and gradients equal
(gradients compared in HF names through the weight mapping); full steps lower the loss; save/load resumes
bit-exactly; the HF export loads into transformers and gives the trainer's logprobs. One process holds one
set of megatron parallel groups, so this module's backends share them (world size 1).
"""

from __future__ import annotations

import multiprocessing as mp
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
from miles.train.megatron.weights import tensor_rules, unfuse
from miles.types import AdamParams, Datum

pytestmark = pytest.mark.gpu
SMALL = TinyModelSpec(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    intermediate_size=512, seed=3,
)  # fmt: skip
KEY = "full"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("small-qwen3"), SMALL)


def batch(loss_fn: str, seed: int = 0, lengths: tuple[int, ...] = (17, 33, 9, 24)) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, SMALL.vocab_size, n + 1).astype(np.int64)
        inputs = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0.0, 1.0, n).astype(np.float32)
        else:
            inputs["logprobs"] = (-np.log(SMALL.vocab_size) + rng.normal(0, 0.3, n)).astype(np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
        data.append(Datum(tokens[:-1], inputs))
    return data


@pytest.fixture(scope="module")
def fp32_pair(small_model: Path) -> tuple[TransformersBackend, MegatronBackend]:
    hf = TransformersBackend(
        str(small_model), train_mode="full", device="cuda", dtype=torch.float32, compile_layers=False
    )
    return hf, MegatronBackend(str(small_model), train_mode="full", device="cuda", dtype=torch.float32)


def flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def test_fp32_logprobs_equal_the_transformers_backend(fp32_pair) -> None:
    hf, mc = fp32_pair
    data = batch("cross_entropy")
    ref = hf.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True)
    got = mc.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True)
    np.testing.assert_allclose(flat(got.logprobs), flat(ref.logprobs), atol=2e-4, rtol=0)


def test_bf16_logprobs_equal_within_bf16_tolerance(small_model: Path) -> None:
    hf = TransformersBackend(
        str(small_model), train_mode="full", device="cuda", dtype=torch.bfloat16, compile_layers=False
    )
    mc = MegatronBackend(str(small_model), train_mode="full", device="cuda", dtype=torch.bfloat16)
    data = batch("cross_entropy", seed=1)
    ref = flat(hf.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True).logprobs)
    got = flat(mc.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True).logprobs)
    assert np.abs(got - ref).mean() < 2e-2 and np.abs(got - ref).max() < 0.15


def megatron_grads_in_hf_names(mc: MegatronBackend) -> dict[str, torch.Tensor]:
    params = dict(mc.gpt.named_parameters())
    grads: dict[str, torch.Tensor] = {}
    for rule in tensor_rules(mc.shape):
        grads.update(unfuse(rule, params[rule.mcore_name].main_grad.float(), mc.shape))
    return grads


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {"clip_low_threshold": 0.9})],
)
def test_loss_values_and_gradients_equal(fp32_pair, loss_fn: str, config: dict) -> None:
    hf, mc = fp32_pair
    data = batch(loss_fn, seed=2)
    for backend in (hf, mc):
        backend.reset(KEY)
    ref = hf.forward_backward(KEY, data, loss_fn, config)
    got = mc.forward_backward(KEY, data, loss_fn, config)
    np.testing.assert_allclose(flat(got.elementwise_loss), flat(ref.elementwise_loss), atol=5e-4, rtol=1e-4)
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-4, abs=1e-3)
    ref_grads = {name: p.grad for name, p in hf.named_trainable_parameters(KEY)}
    got_grads = megatron_grads_in_hf_names(mc)
    assert got_grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        scale = float(ref_grad.abs().max()) + 1e-6
        assert float((got_grads[name] - ref_grad).abs().max()) / scale < 2e-3, name
    for backend in (hf, mc):
        backend.reset(KEY)


def test_full_steps_lower_the_loss(fp32_pair) -> None:
    _, mc = fp32_pair
    mc.reset(KEY)
    data = batch("cross_entropy", seed=4)
    adam = AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=1.0)
    losses = []
    for _ in range(6):
        losses.append(mc.forward_backward(KEY, data, "cross_entropy", {}).metrics["loss:sum"])
        metrics = mc.optim_step(KEY, adam)
        assert metrics["grad_norm:mean"] > 0
    assert losses[-1] < 0.7 * losses[0], losses
    mc.reset(KEY)


@sdpa_kernel(SDPBackend.MATH)  # the fused attention backward kernels accumulate in a varying order
def test_save_and_load_resume_bit_exactly(fp32_pair, tmp_path: Path) -> None:
    _, mc = fp32_pair
    mc.reset(KEY)
    data, probe = batch("cross_entropy", seed=5), batch("cross_entropy", seed=6)
    adam = AdamParams(learning_rate=1e-3)

    def train_step() -> None:
        mc.forward_backward(KEY, data, "cross_entropy", {})
        mc.optim_step(KEY, adam)

    train_step()
    mc.save_state(KEY, tmp_path / "ckpt", with_optimizer=True)
    train_step()
    expected = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    mc.load_state(KEY, tmp_path / "ckpt", with_optimizer=True)
    train_step()
    resumed = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    assert np.array_equal(resumed, expected)
    mc.load_state(KEY, tmp_path / "ckpt", with_optimizer=False)  # a fresh Adam takes a different step
    train_step()
    fresh = flat(mc.forward_backward(KEY, probe, "cross_entropy", {}, forward_only=True).logprobs)
    assert not np.array_equal(fresh, expected)
    mc.reset(KEY)


def test_the_hf_export_loads_into_transformers_with_the_trainers_logprobs(fp32_pair, tmp_path: Path) -> None:
    _, mc = fp32_pair
    mc.reset(KEY)
    data = batch("cross_entropy", seed=7)
    mc.forward_backward(KEY, data, "cross_entropy", {})
    mc.optim_step(KEY, AdamParams(learning_rate=1e-3))
    trained = flat(mc.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True).logprobs)
    mc.export_hf_weights(tmp_path / "export")
    exported = TransformersBackend(
        str(tmp_path / "export"), train_mode="full", device="cuda", dtype=torch.float32, compile_layers=False
    )
    got = flat(exported.forward_backward(KEY, data, "cross_entropy", {}, forward_only=True).logprobs)
    np.testing.assert_allclose(got, trained, atol=2e-4, rtol=0)
    mc.reset(KEY)


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 323, 846]
GROUP = "megatron-gpu-test"


def _prompt_logprobs(logits: torch.Tensor) -> np.ndarray:
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])
    return lp[:, 0].numpy()


def _megatron_trainer(model_dir: str, port: int, queue: mp.Queue) -> None:
    """One optimizer step, then the push: every HF-named tensor, gathered, in one gloo broadcast."""
    from miles.engines.weight_group import create_weight_update_group

    torch.set_num_threads(1)
    try:
        backend = MegatronBackend(model_dir, train_mode="full", device="cuda", dtype=torch.float32)
        tokens = np.array(PROMPT, dtype=np.int64)
        ones = np.ones(len(PROMPT) - 1, np.float32)
        datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": ones})
        backend.forward_backward(KEY, [datum], "cross_entropy", {})
        backend.optim_step(KEY, AdamParams(learning_rate=1e-2))
        after = backend.forward_backward(KEY, [datum], "cross_entropy", {}, forward_only=True)
        named = [(n, t.detach().to("cpu").contiguous()) for n, t in backend.iter_hf_weights()]
    except BaseException as exc:  # the test reports it instead of waiting for weights that never come
        queue.put(repr(exc))
        raise
    queue.put(([(n, str(t.dtype), list(t.shape)) for n, t in named], after.logprobs[0]))
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend="gloo", group_name=GROUP
    )
    group.broadcast(torch.cat([t.view(torch.uint8).flatten() for _, t in named]))
    queue.get(timeout=60)  # the engine has loaded: only then tear the group down
    group.destroy()


async def test_the_push_reproduces_the_trainers_logprobs_on_the_engine(
    small_model: Path, monkeypatch
) -> None:
    """The CPU engine (on CUDA) takes the megatron trainer's HF-named weights and gives its logprobs."""
    from miles.engines.cpu.engine import Engine
    from miles.engines.weight_group import pick_master_port

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = Engine(str(small_model))
    await engine.load()
    await engine.wait_loaded()
    runner = engine.model()
    port = pick_master_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=_megatron_trainer, args=(str(small_model), port, queue), daemon=True)
    trainer.start()
    try:
        sent = queue.get(timeout=60)
        assert not isinstance(sent, str), f"the megatron trainer failed: {sent}"
        specs, after = sent
        before = _prompt_logprobs(runner.forward(PROMPT, None, None)[0])
        assert np.abs(after - before).max() > 1e-2, "the optimizer step should move the logprobs"
        await engine.init_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=GROUP,
            backend="gloo",
        )  # fmt: skip
        names, dtypes, shapes = (list(x) for x in zip(*specs, strict=True))
        await engine.load_received(await engine.receive_bucket(GROUP, names, dtypes, shapes, flattened=True))
        queue.put("loaded")
        np.testing.assert_allclose(_prompt_logprobs(runner.forward(PROMPT, None, None)[0]), after, atol=1e-3)
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
        await engine.close()
    assert trainer.exitcode == 0
