"""The CPU engine's `/weights_checker` (SGLang's route and body): "checksum" as SGLang computes it on CPU
(weight_checker._hash_tensor -> mm_utils.tensor_hash: the first 8 bytes of sha256 of the tensor's bytes,
big-endian, as 16 hex digits), "miles_digest" (what a delta push is checked with), SGLang's answer shape,
and SGLang's refusal of an action it does not know (400, success false), which the driver reads as
"this engine takes no deltas"."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import torch

from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import DIGEST_ACTION, SGLangApiClient
from miles.utils import delta
from miles.utils.http import close_clients


@pytest.fixture
def http(cpu_engine):
    with httpx.Client(base_url=cpu_engine.url, timeout=60) as c:
        yield c


def _params(cpu_engine) -> dict[str, torch.Tensor]:
    return {name: p.data for name, p in cpu_engine.app.state.engine.model().params.items()}


def test_checksum_is_sglangs_cpu_hash_of_every_parameter_in_sglangs_shape(cpu_engine, http) -> None:
    body = http.post("/weights_checker", json={"action": "checksum"}).json()
    assert body["success"] is True
    (rank,) = body["ranks"]
    params = _params(cpu_engine)
    assert set(rank["checksums"]) == set(params)
    for name, tensor in params.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert rank["checksums"][name] == hashlib.sha256(raw).digest()[:8].hex(), name
    overall = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        overall.update(name.encode())
        overall.update(rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == overall.hexdigest()
    assert body["per_engine_checksum"] == hashlib.sha256(overall.hexdigest().encode()).hexdigest()
    assert rank["parallelism_info"][0]["tp_size"] == 1
    # a GET with no body is SGLang's default action, checksum
    assert http.get("/weights_checker").json()["ranks"][0]["checksums"] == rank["checksums"]


def test_skip_tensor_list_leaves_out_tensors_whose_names_contain_a_pattern(http) -> None:
    body = http.post("/weights_checker", json={"action": "checksum", "skip_tensor_list": ["mlp"]}).json()
    names = set(body["ranks"][0]["checksums"])
    assert names and not any("mlp" in n for n in names)


async def test_the_digest_action_answers_the_digest_of_each_parameter(cpu_engine) -> None:
    client = SGLangApiClient(cpu_engine.url)
    try:
        body = await client.weights_checker(DIGEST_ACTION)
        assert body["ranks"][0]["checksums"] == delta.digest_many(_params(cpu_engine).items())
        with pytest.raises(EngineRefused, match="Unsupported action='snapshot'"):
            await client.weights_checker("snapshot")  # SGLang's own, not this engine's: refused, 400
    finally:
        await close_clients()
