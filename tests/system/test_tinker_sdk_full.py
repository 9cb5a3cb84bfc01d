"""Full fine-tuning through the real tinker SDK on the production Ray runtime (preset train_mode: full):
rank=0 creates the model, one model owns the trainer at a time, and save_weights_external exports the
trained weights, which the SDK's download helper fetches and transformers loads to the trainer's logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_ray_gateway

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY = "tml-full-finetune-0001"
ROWS = [[3, 17, 90, 4, 55, 21], [8, 8, 300, 12]]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("gateway-full")
    proc = start_ray_gateway(tiny_model_dir, workdir, {KEY: "alpha"}, "--train-mode", "full")
    yield proc
    proc.stop()


def _datum(tokens: list[int]) -> types.Datum:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _hf_logprobs(model_dir: Path) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for tokens in ROWS:
            rows = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0].float(), dim=-1)
            out.append(rows.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy())
    return out


def test_full_fine_tuning_exports_the_trained_weights(
    gateway: GatewayProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tinker.cli.commands.checkpoint import _download_external_weights

    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()
    info = tc.get_info()
    assert (info.is_lora, info.model_data.arch) == (False, "qwen3")
    with pytest.raises(tinker.RequestFailedError, match="owns the trainer"):
        service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()

    data = [_datum(t) for t in ROWS]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    export = tc.save_weights_external("full-hf").result().path
    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY)
    _download_external_weights(rest, export, tmp_path / "dl", show_progress=False, format="json")

    trainer = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    for got, want in zip(_hf_logprobs(tmp_path / "dl"), trainer, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    base = _hf_logprobs(tiny_model_dir)
    assert max(float(np.abs(b - t).max()) for b, t in zip(base, trainer, strict=True)) > 1e-3
