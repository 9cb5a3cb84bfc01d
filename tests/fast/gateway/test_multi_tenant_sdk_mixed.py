"""Four tenants (their own API keys) train at once through the real tinker SDK, the way users would mix
them: every loss, forward next to forward_backward, their own AdamW settings, one tenant's bad batches,
another's save_state + load_state and a third one's sampling in the middle. Run once with batching off
(window 0) and once with a window: every tenant gets the same results either way, and the bad batches
fail as that tenant's user errors only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from miles.contract.losses import LOSS_NAMES
from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from tests.fast.local_gateway import cpu_engine, local_gateway

pytestmark = pytest.mark.slow
MODEL = "tiny"
KEYS = {f"tml-mixed-tenant-{i}": f"tenant{i}" for i in range(4)}
STEPS = 5
LOSS_CONFIGS: dict[str, dict[str, float]] = {"dro": {"beta": 0.1}, "ppo": {"clip_low_threshold": 0.9}}
ADAM = [
    types.AdamParams(learning_rate=1e-2),
    types.AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, weight_decay=0.1),
    types.AdamParams(learning_rate=5e-3, eps=1e-6, grad_clip_norm=0.5),
    types.AdamParams(learning_rate=1e-3, beta1=0.5),
]
BAD_BATCHES = {  # tenant 3 sends each after its first step
    "token id outside the vocabulary": ([1, 2, 10**7], [1, 2, 3]),
    "targets not aligned with the input": ([1, 2, 3], [1, 2]),
    "empty input": ([], []),
    "longer than the context": (list(range(3000)), list(range(3000))),
}


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, LocalRuntime]]:
    with cpu_engine(tiny_model_dir, tmp_path / "engine.log") as engine:
        backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        runtime = LocalRuntime(tiny_model_dir, model_name=MODEL, engine=engine, backend=backend)
        with local_gateway(runtime, tmp_path / "ckpt", KEYS) as url:
            yield url, runtime


def datum(tokens: list[int], targets: list[int], loss: str, rng: np.random.Generator) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": targets}
    if loss == "cross_entropy":
        inputs["weights"] = [1.0] * len(targets)
    else:  # the RL losses: the sampler's logprobs and advantages
        inputs["logprobs"] = (-3 * rng.random(len(targets))).tolist()
        inputs["advantages"] = rng.standard_normal(len(targets)).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def batch(tenant: int, step: int, loss: str) -> list[types.Datum]:
    rng = np.random.default_rng(1000 * tenant + step)
    rows = [rng.integers(3, 1000, n + 1).tolist() for n in (5 + tenant, 9, 3)]
    return [datum(r[:-1], r[1:], loss, rng) for r in rows]


def logprobs(out: Any) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float64) for o in out.loss_fn_outputs]


def tenant(url: str, i: int, log: list[Any]) -> None:
    """STEPS steps of tenant i: each a forward_backward with the step's loss and an optim_step, every third
    a forward instead; tenant 1 saves and loads its state, tenant 2 samples, tenant 3 sends bad batches."""
    key = list(KEYS)[i]
    client = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model=MODEL, rank=(2, 4, 8, 16)[i], seed=i, train_unembed=i == 0, train_mlp=i != 1
    )
    for step in range(STEPS):
        loss = LOSS_NAMES[(i + step) % len(LOSS_NAMES)]
        call = client.forward if step % 3 == 2 else client.forward_backward
        out = call(batch(i, step, loss), loss, loss_fn_config=LOSS_CONFIGS.get(loss)).result(timeout=120)
        log.append((loss, logprobs(out), out.metrics["loss:sum"]))
        if i == 3 and step == 0:
            for name, (tokens, targets) in BAD_BATCHES.items():
                bad = [datum(tokens, targets, "cross_entropy", np.random.default_rng(0))]
                with pytest.raises(tinker.RequestFailedError) as failed:
                    client.forward_backward(bad, "cross_entropy").result(timeout=120)
                log.append((name, failed.value.category))
        log.append(client.optim_step(ADAM[i]).result(timeout=120).metrics)
        if i == 1 and step == 2:
            client.load_state(client.save_state(f"mid-{step}").result(timeout=120).path).result(timeout=120)
        if i == 2 and step == 2:
            sampler = client.save_weights_and_get_sampling_client(f"s-{step}")
            prompt = types.ModelInput.from_ints([5, 6, 7])
            params = types.SamplingParams(max_tokens=4, temperature=0.0)
            log.append(sampler.sample(prompt, 1, params).result(timeout=120).sequences[0].tokens)


def run_tenants(url: str) -> list[list[Any]]:
    logs: list[list[Any]] = [[] for _ in KEYS]
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            tenant(url, i, logs[i])
        except BaseException as exc:  # reraised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(len(KEYS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    if errors:
        raise errors[0]
    return logs


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, tuple) and len(want) == 3:  # (loss, logprobs, loss:sum)
        assert got[0] == want[0]
        for g, w in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert got[2] == pytest.approx(want[2], rel=1e-5, abs=1e-5)
    elif isinstance(want, dict):  # optim_step metrics
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    else:
        assert got == want


def test_four_tenants_mixing_everything_get_what_they_get_without_batching(served) -> None:
    url, runtime = served
    runtime.coalescer.window_s = 0.0
    alone = run_tenants(url)
    runtime.coalescer.window_s = 0.05
    batched = run_tenants(url)
    assert runtime.coalescer.stats.largest >= 2  # some requests did share a pass
    for got, want in zip(batched, alone, strict=True):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    errors = [entry for entry in batched[3] if isinstance(entry, tuple) and len(entry) == 2]
    assert errors == [(name, RequestErrorCategory.User) for name in BAD_BATCHES]
