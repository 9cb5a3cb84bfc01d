"""Full fine-tuning through the real tinker SDK on the production Ray runtime (preset train_mode: full):
rank=0 creates the model, one model owns the trainer at a time, and save_weights_external exports the
trained weights, which the SDK's download helper fetches and transformers loads to the trainer's logprobs.
Unnamed sampler saves (save_weights_and_get_sampling_client) write nothing and sample the trainer's
weights until the next save; named ones are written (behind the save's answer), listed and open by path.
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


@pytest.fixture(scope="module")
def service(gateway: GatewayProcess) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=gateway.url, api_key=KEY)


@pytest.fixture(scope="module")
def tc(service: tinker.ServiceClient) -> tinker.TrainingClient:
    """The module's one full fine-tuning model (it owns the trainer for the module's tests)."""
    return service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()


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
    gateway: GatewayProcess,
    service: tinker.ServiceClient,
    tc: tinker.TrainingClient,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    from tinker.cli.commands.checkpoint import _download_external_weights

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


PROMPT = [3, 17, 90, 4, 55, 21]
SAMPLING = types.SamplingParams(max_tokens=4, temperature=1.0)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def _checkpoint_ids(rest: tinker.RestClient, model_id: str) -> set[str]:
    return {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints}


def _samples_the_trainers_weights(sampler: tinker.SamplingClient, tc: tinker.TrainingClient) -> None:
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, SAMPLING).result().sequences[0]
    out = tc.forward([_datum(PROMPT + list(seq.tokens))], "cross_entropy").result().loss_fn_outputs[0]
    trainer = out["logprobs"].to_numpy()[-len(seq.tokens) :]
    np.testing.assert_allclose(seq.logprobs, trainer, atol=2e-4)


def test_unnamed_sampler_saves_write_nothing_and_sample_until_the_next_save(
    gateway: GatewayProcess, service: tinker.ServiceClient, tc: tinker.TrainingClient
) -> None:
    root = gateway.workdir / "checkpoints"
    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY)
    files, listed = _files(root), _checkpoint_ids(rest, tc.model_id)

    first = tc.save_weights_and_get_sampling_client().result()
    assert _files(root) == files and _checkpoint_ids(rest, tc.model_id) == listed  # nothing written
    _samples_the_trainers_weights(first, tc)

    tc.forward_backward([_datum(t) for t in ROWS], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    second = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="is stale") as stale:
        first.sample(types.ModelInput.from_ints(PROMPT), 1, SAMPLING).result()
    assert stale.value.category.value == "user"
    _samples_the_trainers_weights(second, tc)  # the trained weights, pushed by the second save
    assert _files(root) == files

    ephemeral = f"tinker://{tc.model_id}/sampler_weights/ephemeral:0"
    with pytest.raises(tinker.NotFoundError, match="not saved to disk"):
        service.create_sampling_client(model_path=ephemeral).result()

    named = tc.save_weights_for_sampler("kept").result().path
    assert _checkpoint_ids(rest, tc.model_id) == listed | {"sampler_weights/kept"}
    assert any(p.name.endswith(".safetensors") for p in _files(root) - files)
    _samples_the_trainers_weights(service.create_sampling_client(model_path=named).result(), tc)


def test_a_named_save_is_written_behind_and_keeps_the_weights_it_was_given(
    gateway: GatewayProcess, service: tinker.ServiceClient, tc: tinker.TrainingClient
) -> None:
    """The save answers once the snapshot is taken (a host copy); its files follow while the job trains on.
    The snapshot samples at once, and its files hold the weights of the save, not the step after it."""
    data = [_datum(t) for t in ROWS]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    at_save = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    path = tc.save_weights_for_sampler("behind").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    _samples_the_trainers_weights(sampler, tc)  # served by the push, files or not
    for _ in range(2):  # the trainer moves on while (or after) the files are written
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY)
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed["sampler_weights/behind"].size_bytes > 0  # listed whole: the listing waits for the commit
    saved = gateway.workdir / "checkpoints" / tc.model_id / "sampler_weights" / "behind"
    assert not list(saved.glob("*.written")) and not list(saved.parent.parent.parent.glob(".staging/*"))
    now = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    for got, want, moved in zip(_hf_logprobs(saved), at_save, now, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert float(np.abs(got - moved).max()) > 1e-3
