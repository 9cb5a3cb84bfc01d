"""The CPU engine's `/release_memory_occupation` and `/resume_memory_occupation` (SGLang 0.5.23's shapes
and rules), what they do to the model's memory, and how requests and weight updates behave meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.cpu.memory import NOT_IDLE, WEIGHTS_RELEASED
from miles.engines.cpu.requests import Phase
from miles.engines.cpu.runner import ModelRunner
from miles.engines.cpu.server import create_app
from miles.engines.errors import EngineError, EngineRefused
from miles.engines.sglang_client import SGLangApiClient
from miles.models.tiny import TinyModelSpec, build_tiny_model
from miles.utils.http import close_clients
from miles.utils.serving import ServerThread
from miles.utils.tensor_ipc import serialize_named_tensors
from tests.fast.engines.conftest import wait_healthy

PROMPT = [3, 14, 15, 92, 65]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
ALL = ["cuda_graph", "kv_cache", "weights"]


def _serve(model_dir: Path, **flags: bool) -> Iterator[ServerThread]:
    app = create_app(str(model_dir), **flags)
    with ServerThread(app) as srv:
        srv.app = app  # type: ignore[attr-defined]
        wait_healthy(srv.url)
        yield srv


@pytest.fixture(scope="module")
def bookkeeping(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """No --enable-memory-saver: release and resume only keep the bookkeeping (SGLang's no-op adapter)."""
    yield from _serve(tiny_model_dir)


@pytest.fixture(scope="module")
def saver_with_backup(tiny_model_dir: Path) -> Iterator[ServerThread]:
    yield from _serve(tiny_model_dir, enable_memory_saver=True, enable_weights_cpu_backup=True)


@pytest.fixture(scope="module")
def saver_without_backup(tiny_model_dir: Path) -> Iterator[ServerThread]:
    yield from _serve(tiny_model_dir, enable_memory_saver=True)


@pytest.fixture
async def clients():
    yield lambda srv: SGLangApiClient(srv.url)
    await close_clients()


def _offload_tags(srv: ServerThread) -> list[str]:
    return httpx.get(srv.url + "/server_info").json()["internal_states"][0]["offload_tags"]


def _weight_bytes(srv: ServerThread) -> int:
    runner = srv.app.state.engine.runner  # type: ignore[attr-defined]
    return sum(p.untyped_storage().nbytes() for p in runner.model.parameters())


async def _greedy_logprobs(client: SGLangApiClient) -> list[float]:
    out = await client.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


# ----- shapes and errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_release_and_resume_answer_json_null_and_keep_the_tags(bookkeeping, method: str) -> None:
    for path, expected in (("release", ["kv_cache"]), ("resume", [])):
        r = httpx.request(method, f"{bookkeeping.url}/{path}_memory_occupation", json={"tags": ["kv_cache"]})
        assert (r.status_code, r.content) == (200, b"null")
        assert _offload_tags(bookkeeping) == expected


@pytest.mark.parametrize("empty", [None, []])
def test_no_tags_mean_all_tags(bookkeeping, empty) -> None:
    assert httpx.post(bookkeeping.url + "/release_memory_occupation", json={"tags": empty}).status_code == 200
    assert _offload_tags(bookkeeping) == ALL
    assert httpx.post(bookkeeping.url + "/resume_memory_occupation", json={"tags": empty}).status_code == 200
    assert _offload_tags(bookkeeping) == []


def test_resuming_what_is_not_released_is_a_400_that_changes_nothing(bookkeeping) -> None:
    assert (
        httpx.post(bookkeeping.url + "/release_memory_occupation", json={"tags": ["weights"]}).status_code
        == 200
    )
    try:
        r = httpx.post(bookkeeping.url + "/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
        assert r.status_code == 400
        assert "['kv_cache'] not released" in r.json()["error"]["message"]
        assert _offload_tags(bookkeeping) == ["weights"], "all or nothing: weights stay released"
    finally:
        httpx.post(bookkeeping.url + "/resume_memory_occupation", json={"tags": ["weights"]})
    assert _offload_tags(bookkeeping) == []


def test_unknown_tags_and_missing_bodies_are_400(bookkeeping) -> None:
    r = httpx.post(bookkeeping.url + "/release_memory_occupation", json={"tags": ["weight"]})
    assert r.status_code == 400 and "unknown memory tags ['weight']" in r.json()["error"]["message"]
    r = httpx.post(bookkeeping.url + "/release_memory_occupation")
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"  # SGLang: the body is required
    assert _offload_tags(bookkeeping) == []


async def test_client_methods_send_tags_and_raise_the_engines_answer(bookkeeping, clients) -> None:
    client = clients(bookkeeping)
    assert await client.release_memory_occupation(["kv_cache", "cuda_graph"]) is None
    assert _offload_tags(bookkeeping) == ["cuda_graph", "kv_cache"]
    with pytest.raises(EngineError) as refused:
        await client.resume_memory_occupation(None)  # weights were never released
    assert refused.value.status_code == 400 and "not released" in refused.value.body["error"]["message"]
    assert await client.resume_memory_occupation(["kv_cache", "cuda_graph"]) is None
    assert _offload_tags(bookkeeping) == []


# ----- requests while released --------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["weights", "kv_cache"])
async def test_requests_wait_while_released_and_complete_after_resume(bookkeeping, clients, tag: str) -> None:
    client = clients(bookkeeping)
    expected = await _greedy_logprobs(client)
    await client.release_memory_occupation([tag])
    waiting = asyncio.create_task(_greedy_logprobs(client))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "a request must wait while the engine's memory is released"
    engine = bookkeeping.app.state.engine
    assert engine.count(frozenset({Phase.WAITING})) == 1
    await client.resume_memory_occupation([tag])
    assert await asyncio.wait_for(waiting, 30) == expected


async def test_cuda_graph_alone_does_not_hold_requests(bookkeeping, clients) -> None:
    client = clients(bookkeeping)
    await client.release_memory_occupation(["cuda_graph"])
    try:
        assert len(await asyncio.wait_for(_greedy_logprobs(client), 30)) == GREEDY["max_new_tokens"]
    finally:
        await client.resume_memory_occupation(["cuda_graph"])


async def test_release_is_refused_while_a_request_holds_its_kv_cache(bookkeeping, clients) -> None:
    client = clients(bookkeeping)
    long = {"max_new_tokens": 100_000, "temperature": 0, "ignore_eos": True}
    running = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=long))
    engine = bookkeeping.app.state.engine
    try:
        for _ in range(200):
            if engine.count(frozenset({Phase.RUNNING})):
                break
            await asyncio.sleep(0.05)
        await client.pause_generation("in_place")  # parked with its KV cache: the server is not idle
        with pytest.raises(EngineError) as refused:
            await client.release_memory_occupation(["kv_cache"])
        assert refused.value.status_code == 400
        assert refused.value.body == {"error": {"message": NOT_IDLE}}
        assert _offload_tags(bookkeeping) == []
        # retract drops the KV cache and requeues: paused, SGLang ignores waiting requests
        await client.continue_generation()
        await client.pause_generation("retract")
        await client.release_memory_occupation(["kv_cache"])
        await client.continue_generation()
        await asyncio.sleep(0.3)
        assert engine.count(frozenset({Phase.RETRACTED})) == 1, "released: the retracted request waits"
        await client.resume_memory_occupation(["kv_cache"])
    finally:
        await client.abort_request(abort_all=True)
        out = await asyncio.wait_for(running, 30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["num_retractions"] == 1


async def test_without_the_memory_saver_nothing_is_freed(bookkeeping, clients) -> None:
    client = clients(bookkeeping)
    before = _weight_bytes(bookkeeping)
    await client.release_memory_occupation(["weights"])
    try:
        assert _weight_bytes(bookkeeping) == before > 0
    finally:
        await client.resume_memory_occupation(["weights"])


# ----- what the memory saver does to the weights -------------------------------------------------------


async def test_cpu_backup_keeps_logprobs_identical_after_release_and_resume(
    saver_with_backup, clients
) -> None:
    client = clients(saver_with_backup)
    before = await _greedy_logprobs(client)
    await client.release_memory_occupation(None)
    assert _weight_bytes(saver_with_backup) == 0, "every parameter's memory is freed"
    await client.resume_memory_occupation(None)
    assert _weight_bytes(saver_with_backup) > 0
    assert await _greedy_logprobs(client) == before  # bit-identical: the backup is a byte copy


async def test_without_backup_a_weight_update_after_resume_restores_them(
    saver_without_backup, clients, reference_model
) -> None:
    client = clients(saver_without_backup)
    before = await _greedy_logprobs(client)
    await client.release_memory_occupation(["weights", "kv_cache"])
    assert _weight_bytes(saver_without_backup) == 0
    named = [(n, p.detach().clone()) for n, p in reference_model.named_parameters()]
    payload = serialize_named_tensors(named)
    await client.begin_weight_update()
    try:
        with pytest.raises(EngineRefused, match="resume them first"):
            await client.update_weights_from_tensor([payload])
        await client.resume_memory_occupation(["weights"])
        answer = await client.update_weights_from_tensor([payload], weight_version="restored")
        assert answer == {"success": True, "message": "Success Weight version updated to restored."}
    finally:
        await client.end_weight_update()
    await client.resume_memory_occupation(["kv_cache"])
    assert await _greedy_logprobs(client) == pytest.approx(before, abs=1e-6)


async def test_a_distributed_update_while_weights_are_released_is_refused(
    saver_without_backup, clients
) -> None:
    client = clients(saver_without_backup)
    await client.release_memory_occupation(["weights"])
    await client.begin_weight_update()
    try:
        r = httpx.post(
            saver_without_backup.url + "/update_weights_from_distributed",
            json={"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1024, 64]]},
        )
        assert r.status_code == 400 and r.json() == {"success": False, "message": WEIGHTS_RELEASED}
    finally:
        await client.end_weight_update()
        await client.resume_memory_occupation(["weights"])


# ----- the runner: storages, ties, caches --------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tied"), replace(TinyModelSpec(), tie_word_embeddings=True)
    )


@pytest.mark.parametrize("backup", [True, False])
def test_release_keeps_tied_weights_tied_and_params_live(tied_model_dir: Path, backup: bool) -> None:
    runner = ModelRunner(str(tied_model_dir), device=torch.device("cpu"))
    model = runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    originals = {n: p.detach().clone() for n, p in runner.params.items()}
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    logits, _ = runner.forward(PROMPT, None, None)
    runner.flat_target([("lm_head.weight", torch.float32, list(embedding.shape))], torch.device("cpu"))
    assert runner._flat_targets

    runner.release_weights_memory(cpu_backup=backup)
    assert embedding.untyped_storage().nbytes() == 0 and not runner._flat_targets
    with pytest.raises(EngineRefused, match="resume them first"):
        runner.load_weights([("lm_head.weight", originals["lm_head.weight"])])
    runner.resume_weights_memory()

    assert (
        model.lm_head.weight
        is model.model.embed_tokens.weight
        is embedding
        is runner.params["lm_head.weight"]
    )
    assert runner.params["model.embed_tokens.weight"] is embedding
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq), "buffers are always kept, as in SGLang"
    if not backup:  # undefined until a weight update: load the originals, as a trainer's push would
        assert runner.load_weights(list(originals.items())) == []
    for name, param in runner.params.items():
        assert torch.equal(param.detach(), originals[name]), name
    # one storage, still tied: writing the embedding is writing lm_head
    runner.load_weights([("model.embed_tokens.weight", torch.zeros_like(embedding))])
    assert float(model.lm_head.weight.detach().abs().sum()) == 0.0
    runner.load_weights([("model.embed_tokens.weight", originals["model.embed_tokens.weight"])])
    assert torch.equal(runner.forward(PROMPT, None, None)[0], logits)


def test_ipc_tensors_are_copied_in_never_adopted(tiny_model_dir: Path) -> None:
    runner = ModelRunner(str(tiny_model_dir), device=torch.device("cpu"))
    param = runner.params["lm_head.weight"]
    incoming = torch.randn(param.shape)
    runner.load_weights([("lm_head.weight", incoming)], copy=True)
    assert param.data_ptr() != incoming.data_ptr() and torch.equal(param.detach(), incoming)
    runner.load_weights([("lm_head.weight", incoming)])  # the gloo path adopts a receive buffer
    assert param.data_ptr() == incoming.data_ptr()
