"""Server-side custom losses through the real tinker SDK, the gateway and a LoRA trainer: create_custom_loss
uploads the traced loss, forward_backward_custom runs it on the trainer in one request, and the result, the
metrics and the trained adapter equal the SDK's client-side custom loss (two requests). What the server
refuses reaches the SDK call with the reason; a loss runs only for its own session and tenant."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch.nn.functional as F
from tinker import types

from bench.custom_loss import RANKS, client_side, dpo_style
from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from tests.fast.local_gateway import cpu_engine, local_gateway

pytestmark = pytest.mark.slow
KEYS = {"tml-custom-loss-alpha": "alpha", "tml-custom-loss-beta": "beta"}
ALPHA, BETA = list(KEYS)
MODEL = "tiny"
ADAM = types.AdamParams(learning_rate=1e-2)


def batch(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for i, length in enumerate((6, 9, 5, 8)):
        tokens = rng.integers(3, 1000, length + 1).tolist()
        inputs = {
            "target_tokens": tokens[1:],
            "weights": types.TensorData.from_numpy((rng.random(length) > 0.3).astype(np.float32)),
            "ref_logprob": types.TensorData(data=[-7.0 * length], dtype="float32", shape=[]),
            "sign": types.TensorData(data=[1.0 if i % 2 else -1.0], dtype="float32", shape=[]),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LocalRuntime]]:
    tmp = tmp_path_factory.mktemp("custom-loss")
    with cpu_engine(tiny_model_dir, tmp / "engine.log") as engine:
        backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        runtime = LocalRuntime(tiny_model_dir, model_name=MODEL, engine=engine, backend=backend)
        with local_gateway(runtime, tmp / "ckpt", KEYS) as url:
            yield url, runtime


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float32) for o in out.loss_fn_outputs]


def test_a_server_side_loss_trains_as_the_client_side_loss_in_one_request(served) -> None:
    url, runtime = served
    service = tinker.ServiceClient(base_url=url, api_key=ALPHA)
    handle = service.create_custom_loss(dpo_style, RANKS).result()
    assert handle.loss_id is not None  # the server said it runs them: uploaded, not kept client-side
    server = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    local = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    untrained = _logprobs(server.forward(batch(9), "cross_entropy").result())
    for step in range(2):
        data = batch(step)
        before = runtime.coalescer.stats.requests
        ours = server.forward_backward_custom(data, handle).result()
        assert runtime.coalescer.stats.requests - before == 1
        theirs = local.forward_backward_custom(data, client_side).result()
        assert runtime.coalescer.stats.requests - before == 3  # a forward, then the backward
        for got, want in zip(_logprobs(ours), _logprobs(theirs), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for key in ("loss:sum", "custom/accuracy:mean", "custom/margin:sum"):
            assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-4, abs=1e-5), key
        assert 0 < ours.metrics["custom/accuracy:mean"] < 1
        spread = [np.asarray(o["elementwise_loss"].data).sum() for o in ours.loss_fn_outputs]
        assert sum(spread) == pytest.approx(ours.metrics["loss:sum"], rel=1e-5)
        server.optim_step(ADAM).result()
        local.optim_step(ADAM).result()
    after = [_logprobs(c.forward(batch(9), "cross_entropy").result()) for c in (server, local)]
    assert not np.allclose(after[0][0], untrained[0], atol=1e-4)  # the steps moved the adapter
    for got, want in zip(*after, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_what_the_server_refuses_reaches_the_sdk_call_with_the_reason(served) -> None:
    url, _ = served
    service = tinker.ServiceClient(base_url=url, api_key=ALPHA)

    def gelu_loss(logprobs):  # torch, so the SDK allows it; not on this server's allow-list
        return F.gelu(logprobs).sum(), {}

    with pytest.raises(tinker.BadRequestError, match=r"torch\._C\._nn\.gelu"):
        service.create_custom_loss(gelu_loss, {"logprobs": 1}).result()

    handle = service.create_custom_loss(dpo_style, RANKS).result()
    client = service.create_lora_training_client(base_model=MODEL, rank=2).result()
    data = batch(0)
    short = dict(data[1].loss_fn_inputs)
    short["weights"] = types.TensorData.from_numpy(np.ones(3, np.float32))
    data[1] = types.Datum(model_input=data[1].model_input, loss_fn_inputs=short)
    with pytest.raises(Exception, match="datum 1: loss_fn_inputs\\['weights'\\] has 3 rows"):
        client.forward_backward_custom(data, handle).result()
    client.forward_backward_custom(batch(1), handle).result()  # the model's order goes on


def test_a_loss_runs_only_for_its_own_session_and_tenant(served) -> None:
    url, _ = served
    owner = tinker.ServiceClient(base_url=url, api_key=ALPHA)
    handle = owner.create_custom_loss(dpo_style, RANKS).result()
    for key, reason in ((ALPHA, "belongs to session"), (BETA, "no custom loss")):
        other = tinker.ServiceClient(base_url=url, api_key=key)
        client = other.create_lora_training_client(base_model=MODEL, rank=2).result()
        # the SDK refuses a handle of another session; the server must too, for a client that lies
        forged = dataclasses.replace(handle, session_id=other.holder.get_session_id())
        with pytest.raises(Exception, match=reason):
            client.forward_backward_custom(batch(0), forged).result()
