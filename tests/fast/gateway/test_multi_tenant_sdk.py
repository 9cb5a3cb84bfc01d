"""Three tinker SDK training clients at once through the gateway and the local runtime: their
forward_backward requests share one trainer command, and each client's results, and its adapter after a
step, equal the client trained alone on its own backend."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams
from tests.fast.local_gateway import cpu_engine, local_gateway
from tests.fast.train.test_step_recovery_gateway import ref_data, rows, sdk_data

pytestmark = pytest.mark.slow
KEY = "tml-multi-tenant-0001"
MODEL = "tiny"
LR = 1e-2
# The first request of the first round has no companion yet (no other model has sent): it goes alone and
# the other two wait out the window for its next request, which comes only after theirs. From then on,
# every client has sent and each round is one command. So the window is short enough to wait out.
WINDOW_S = 0.5


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, LocalRuntime]]:
    with cpu_engine(tiny_model_dir, tmp_path / "engine.log") as engine:
        backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        runtime = LocalRuntime(
            tiny_model_dir, model_name=MODEL, engine=engine, backend=backend, lora_batch_window_s=WINDOW_S
        )
        # every model that ever sent counts as a companion, however slow this machine is between steps
        runtime.coalescer.active_s = math.inf
        with local_gateway(runtime, tmp_path / "ckpt", KEY) as url:
            yield url, runtime


def test_three_sdk_clients_share_passes_and_train_as_alone(served, tiny_model_dir: Path) -> None:
    url, runtime = served
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    clients = [
        service.create_lora_training_client(base_model=MODEL, rank=2 + i, seed=i).result() for i in range(3)
    ]
    backend = runtime._trainer.backend
    keys = backend.model_keys()
    batches = [[rows(10 * i + step, [5 + i, 7]) for step in range(2)] for i in range(3)]

    outputs = []
    for step in range(2):  # all three clients at once, then each its step
        futures = [
            c.forward_backward(sdk_data(b[step]), "cross_entropy")
            for c, b in zip(clients, batches, strict=True)
        ]
        outputs.append([f.result(timeout=120) for f in futures])
        # all three steps at once: one merged command
        steps = [client.optim_step(types.AdamParams(learning_rate=LR)) for client in clients]
        [step.result(timeout=60) for step in steps]
    # the first forward_backward round: one alone, then the other two (or all three, if they came at
    # once); then one command a round
    stats = runtime.coalescer.stats
    assert stats.requests == 12 and stats.commands <= 5 and stats.largest == 3

    for i, key in enumerate(keys):
        alone = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        alone.create_adapter(key, backend.lora.get(key).spec)
        for step in range(2):
            want = alone.forward_backward(key, ref_data(batches[i][step]), "cross_entropy", {})
            alone.optim_step(key, AdamParams(learning_rate=LR))
            got = [np.asarray(o["logprobs"].data, np.float32) for o in outputs[step][i].loss_fn_outputs]
            for lp, ref in zip(got, want.logprobs, strict=True):
                np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)
        trained = dict(backend.named_trainable_parameters(key))
        for name, param in alone.named_trainable_parameters(key):
            torch.testing.assert_close(trained[name], param, rtol=1e-5, atol=1e-6, msg=name)
