"""External weights uploads (tinker 0.39/0.40's published HTTP shapes, raw HTTP: the 0.38 SDK on the index
has no such call), against the real CPU engine and a LoRA trainer: an adapter trained by one tenant, taken
out of its sampler checkpoint and uploaded by another, samples exactly as the original through the real
SDK. What does not fit the base is refused at finish with the reason, and the upload stays open to fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from safetensors.torch import load_file, save_file
from tinker import types

from miles.contract.lora_layout import adapter_layout, lora_targets
from miles.gateway.services.uploads import MAX_OPEN_UPLOADS, base_weight_shapes
from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import LoraSpec
from tests.fast.local_gateway import cpu_engine, local_gateway

pytestmark = pytest.mark.slow

KEYS = {"tml-upload-trainer-01": "trainer", "tml-upload-receiver-1": "receiver"}
TRAINER, RECEIVER = list(KEYS)
MODEL = "tiny"
PROMPT = types.ModelInput.from_ints([5, 17, 42, 9])
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("upload")
    with cpu_engine(tiny_model_dir, tmp / "engine.log") as engine:
        backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        runtime = LocalRuntime(tiny_model_dir, model_name=MODEL, engine=engine, backend=backend)
        with local_gateway(runtime, tmp / "ckpt", KEYS) as url:
            yield url, tmp / "ckpt"


@pytest.fixture(scope="module")
def trained(served) -> tuple[Path, list[int]]:
    """A rank-4 adapter trained a few steps: its sampler checkpoint's files and its greedy completion."""
    url, root = served
    service = tinker.ServiceClient(base_url=url, api_key=TRAINER)
    client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 17, 42, 9, 7, 7, 7]),
        loss_fn_inputs={"target_tokens": [17, 42, 9, 7, 7, 7, 7], "weights": [1.0] * 7},
    )
    for _ in range(3):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = client.save_weights_for_sampler("trained").result().path
    sampled = service.create_sampling_client(model_path=path).sample(PROMPT, 1, GREEDY).result()
    return root.joinpath(*path.removeprefix("tinker://").split("/")), list(sampled.sequences[0].tokens)


def _start(url: str, *, rank: int = 4, version: str = "0.39.0", **lora) -> httpx.Response:
    body = {"base_model": MODEL, "lora_config": {"rank": rank, **lora}, "destination_project_id": "imports"}
    headers = {"X-API-Key": RECEIVER, "X-Stainless-Package-Version": version}
    return httpx.post(f"{url}/api/v1/external_weights_upload_start", json=body, headers=headers)


def _finish(url: str, upload_id: str, key: str = RECEIVER) -> httpx.Response:
    return httpx.post(
        f"{url}/api/v1/external_weights_upload_finish",
        json={"upload_id": upload_id},
        headers={"X-API-Key": key},
    )


def _put(target: str | dict, data: bytes) -> httpx.Response:
    url, headers = (target, {}) if isinstance(target, str) else (target["url"], target["headers"])
    return httpx.put(url, content=data, headers=headers)  # no API key: the signature is the credential


def test_an_uploaded_adapter_samples_as_the_original(served, trained) -> None:
    url, _ = served
    files, original = trained
    start = _start(url)
    assert start.status_code == 200, start.text
    answer = start.json()
    assert set(answer["urls"]) == {"adapter_config.json", "adapter_model.safetensors"}
    for name, target in answer["urls"].items():
        assert isinstance(target, str)  # SDK 0.39: a signed URL per file
        assert _put(target, (files / name).read_bytes()).status_code == 200
    finished = _finish(url, answer["upload_id"])
    assert finished.status_code == 200, finished.text
    path = finished.json()["tinker_path"]
    assert path.endswith("/sampler_weights/adapter") and "upload-" in path
    assert _finish(url, answer["upload_id"]).json()["tinker_path"] == path  # a retry: the same checkpoint

    service = tinker.ServiceClient(base_url=url, api_key=RECEIVER)
    sampled = service.create_sampling_client(model_path=path).sample(PROMPT, 1, GREEDY).result()
    assert list(sampled.sequences[0].tokens) == original
    base = service.create_sampling_client(base_model=MODEL).sample(PROMPT, 1, GREEDY).result()
    assert list(base.sequences[0].tokens) != original  # the adapter, not the base, made that completion
    run = service.create_rest_client().get_training_run_by_tinker_path(path).result()
    assert run.is_lora and run.lora_rank == 4 and run.user_metadata == {"project_id": "imports"}
    stranger = tinker.ServiceClient(base_url=url, api_key=TRAINER)
    with pytest.raises(tinker.NotFoundError):
        stranger.create_sampling_client(model_path=path).sample(PROMPT, 1, GREEDY).result()


def test_a_misfit_is_refused_with_the_reason_and_can_be_fixed(served, trained, tmp_path: Path) -> None:
    url, _ = served
    files, _ = trained
    answer = _start(url, version="0.40.1").json()
    urls = answer["urls"]
    assert urls["adapter_model.safetensors"]["headers"] == {"Content-Type": "application/octet-stream"}
    _put(urls["adapter_config.json"], (files / "adapter_config.json").read_bytes())
    missing = _finish(url, answer["upload_id"])
    assert missing.status_code == 400 and "adapter_model.safetensors not uploaded" in missing.text

    tensors = load_file(str(files / "adapter_model.safetensors"))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / "short.safetensors"))
    _put(urls["adapter_model.safetensors"], (tmp_path / "short.safetensors").read_bytes())
    short = _finish(url, answer["upload_id"])
    assert short.status_code == 400 and "1 tensors missing" in short.text and dropped in short.text

    _put(urls["adapter_model.safetensors"], b"not a safetensors file")
    garbage = _finish(url, answer["upload_id"])
    assert garbage.status_code == 400 and "not a safetensors file" in garbage.text

    _put(urls["adapter_model.safetensors"], (files / "adapter_model.safetensors").read_bytes())  # fixed
    assert _finish(url, answer["upload_id"], key=TRAINER).status_code == 404  # not the trainer's upload
    assert _finish(url, answer["upload_id"]).status_code == 200


def test_a_declaration_the_files_disagree_with_names_both(served, trained) -> None:
    url, _ = served
    files, _ = trained
    answer = _start(url, rank=8, train_unembed=False).json()
    for name, target in answer["urls"].items():
        _put(target, (files / name).read_bytes())
    refused = _finish(url, answer["upload_id"])
    assert refused.status_code == 400
    assert "r is 4 but the upload declared lora_config.rank 8" in refused.text
    assert "target_modules" in refused.text and "has shape [4, 64]; the base needs [8, 64]" in refused.text


def test_bad_starts_and_links_are_refused(served, trained) -> None:
    url, _ = served
    files, _ = trained
    unknown = httpx.post(
        f"{url}/api/v1/external_weights_upload_start",
        json={"base_model": "no/such-model", "lora_config": {"rank": 4}},
        headers={"X-API-Key": RECEIVER},
    )
    assert unknown.status_code == 400 and "unknown base_model" in unknown.text
    full = _start(url, rank=0)
    assert full.status_code == 400 and "rank must be >= 1" in full.text
    assert httpx.post(f"{url}/api/v1/external_weights_upload_start", json={}).status_code == 401

    target = _start(url).json()["urls"]["adapter_config.json"]
    forged = target.replace("signature=", "signature=0")
    assert _put(forged, b"{}").status_code == 404
    other_file = target.replace("adapter_config.json", "evil.py")  # the signature covers the file name
    assert _put(other_file, b"{}").status_code == 404
    assert _put(target, (files / "adapter_config.json").read_bytes()).status_code == 200
    assert _finish(url, "0" * 32).status_code == 404


def test_open_uploads_are_bounded_per_tenant(served) -> None:
    url, _ = served
    answers = [_start(url, version="0.39.0") for _ in range(MAX_OPEN_UPLOADS + 1)]
    assert answers[-1].status_code == 429 and "uploads of yours are open" in answers[-1].text
    other = httpx.post(
        f"{url}/api/v1/external_weights_upload_start",
        json={"base_model": MODEL, "lora_config": {"rank": 4}},
        headers={"X-API-Key": TRAINER},
    )
    assert other.status_code == 200  # another tenant's uploads are its own


@pytest.mark.parametrize("train_unembed", [True, False])
def test_the_expected_layout_is_what_the_trainer_exports(
    tiny_model_dir: Path, tmp_path: Path, train_unembed
) -> None:
    backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
    backend.create_adapter("m", LoraSpec(rank=3, train_unembed=train_unembed, train_mlp=False))
    backend.export_adapter("m", tmp_path)
    exported = {
        name: tuple(t.shape) for name, t in load_file(str(tmp_path / "adapter_model.safetensors")).items()
    }
    targets = lora_targets(train_attn=True, train_mlp=False, train_unembed=train_unembed)
    assert adapter_layout(base_weight_shapes(str(tiny_model_dir)), 3, targets) == exported
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 3
