"""CPU engine conformance with SGLang 0.5.23: request validation, response and error shapes, pause modes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from miles.engines.cpu.requests import Phase
from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import SGLangApiClient
from miles.utils.http import close_clients

PROMPT = [11, 42, 7, 99, 5]


@pytest.fixture
async def client(cpu_engine):
    yield SGLangApiClient(cpu_engine.url)
    await close_clients()


@pytest.fixture
def http(cpu_engine):
    with httpx.Client(base_url=cpu_engine.url, timeout=60) as c:
        yield c


async def _wait_phase(cpu_engine, phase: Phase, timeout_s: float = 30) -> None:
    engine = cpu_engine.app.state.engine
    deadline = time.monotonic() + timeout_s
    while engine.count(frozenset({phase})) < 1:
        assert time.monotonic() < deadline, f"no request reached {phase}"
        await asyncio.sleep(0.005)


def _long(max_new_tokens: int = 400, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0, **extra}


# ----- generate ----------------------------------------------------------------------------------------


async def test_generate_reports_the_sampled_tokens_logprobs(
    client, reference_model, sequence_logprobs
) -> None:
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 12, "temperature": 1.3, "top_k": 50, "sampling_seed": 5},
        return_logprob=True,
        logprob_start_len=0,
        rid="shape-1",
    )
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "shape-1" and meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["weight_version"] == "default"
    ids = [t for _, t, _ in meta["output_token_logprobs"]]
    assert ids == out["output_ids"]
    expected = sequence_logprobs(reference_model, PROMPT, out["output_ids"])
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert got == pytest.approx(expected, abs=1e-4)
    # with temperature 1.3 and top-k, some sampled token is not the argmax: its own logprob is reported
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == PROMPT and inputs[0][0] is None
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(
        sequence_logprobs(reference_model, PROMPT[:1], PROMPT[1:]), abs=1e-4
    )


async def test_seed_reproduces_and_n_gives_a_list(client) -> None:
    params = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 123}
    a = await client.generate(input_ids=PROMPT, sampling_params=params)
    b = await client.generate(input_ids=PROMPT, sampling_params=params)
    assert a["output_ids"] == b["output_ids"]
    many = await client.generate(input_ids=PROMPT, sampling_params={**params, "n": 3}, rid="multi")
    assert isinstance(many, list) and len(many) == 3
    assert [m["meta_info"]["id"] for m in many] == ["multi_0", "multi_1", "multi_2"]
    assert len({tuple(m["output_ids"]) for m in many}) > 1


async def test_stop_conditions(client) -> None:
    free = await client.generate(input_ids=PROMPT, sampling_params=_long(6))
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    third = free["output_ids"][2]
    by_id = await client.generate(input_ids=PROMPT, sampling_params=_long(6, stop_token_ids=[third]))
    assert by_id["output_ids"] == free["output_ids"][:3]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    stop_text = free["text"][len(free["text"]) // 2 :][:3]
    if stop_text.strip():
        by_str = await client.generate(input_ids=PROMPT, sampling_params=_long(6, stop=[stop_text]))
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
        assert stop_text not in by_str["text"]
    zero = await client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == []


def test_request_validation_matches_sglang(http) -> None:
    missing = http.post("/generate")
    assert missing.status_code == 400 and missing.json()["object"] == "error"
    unknown = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_tokens": 3}})
    assert unknown.status_code == 400 and isinstance(unknown.json()["error"], str)
    no_input = http.post("/generate", json={"sampling_params": {}})
    assert no_input.status_code == 400
    assert no_input.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }
    bad_value = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"top_p": 2}})
    assert bad_value.status_code == 400 and "top_p" in bad_value.json()["error"]["message"]
    for path in ("/pause_generation", "/init_weights_update_group", "/update_weight_version"):
        resp = http.post(path)
        assert resp.status_code == 400, path
        assert resp.json()["type"] == "Bad Request" and "Field required" in resp.json()["message"]
    bad_mode = http.post("/pause_generation", json={"mode": "later"})
    assert bad_mode.status_code == 400
    lax = http.post("/abort_request", json={"rid": "nothing", "unknown_key": 1})
    assert lax.status_code == 200 and lax.content == b""


def test_status_endpoints(http) -> None:
    assert http.get("/health").status_code == 200
    info = http.get("/model_info").json()
    assert info["served_model_name"] == "tiny" and info["is_generation"] is True
    assert http.get("/get_model_info").json() == info
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"


async def test_text_input_and_streaming(http) -> None:
    with http.stream(
        "POST", "/generate", json={"text": "hello world", "sampling_params": _long(5), "stream": True}
    ) as resp:
        events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]  # cumulative, like SGLang
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


# ----- pause / continue / abort / flush ----------------------------------------------------------------


async def test_pause_in_place_blocks_flush_until_continue(client, cpu_engine) -> None:
    task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=_long(200)))
    await _wait_phase(cpu_engine, Phase.RUNNING)
    await client.pause_generation("in_place")
    with pytest.raises(EngineRefused, match="running-req: 1"):
        await client.flush_cache()
    waiting = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=_long(3)))
    await asyncio.sleep(0.3)
    assert not task.done() and not waiting.done(), "while paused, requests wait"
    await client.continue_generation()
    out, later = await asyncio.gather(task, waiting)
    assert len(out["output_ids"]) == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(later["output_ids"]) == 3
    await client.flush_cache()


async def test_pause_retract_recomputes_and_allows_flush(client, cpu_engine) -> None:
    params = _long(150)
    reference = await client.generate(input_ids=PROMPT, sampling_params=params)
    task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=params))
    await _wait_phase(cpu_engine, Phase.RUNNING)
    await asyncio.sleep(0.05)
    await client.pause_generation("retract")
    await client.flush_cache()  # retracted requests hold no KV cache
    await client.continue_generation()
    out = await task
    assert out["meta_info"]["num_retractions"] >= 1
    assert out["output_ids"] == reference["output_ids"]


async def test_pause_abort_aborts_running_requests(client, cpu_engine) -> None:
    task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=_long(400)))
    await _wait_phase(cpu_engine, Phase.RUNNING)
    await client.pause_generation("abort")
    out = await asyncio.wait_for(task, 10)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 400
    await client.flush_cache()
    await client.continue_generation()


async def test_abort_request_by_rid_and_version_update_aborts(client, cpu_engine) -> None:
    task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=_long(400), rid="victim"))
    await _wait_phase(cpu_engine, Phase.RUNNING)
    await client.abort_request(rid="victim")
    assert (await task)["meta_info"]["finish_reason"]["type"] == "abort"

    task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=_long(400)))
    await _wait_phase(cpu_engine, Phase.RUNNING)
    answer = await client.update_weight_version("v-test")  # abort_all_requests defaults to True
    assert answer == {"success": True, "message": "Weight version updated to v-test", "new_version": "v-test"}
    assert (await task)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await client.model_info())["weight_version"] == "v-test"
    done = await client.generate(input_ids=PROMPT, sampling_params=_long(2))
    assert done["meta_info"]["weight_version"] == "v-test"


# ----- weight-update session rules ---------------------------------------------------------------------


def test_session_rules_in_current_mode(http) -> None:
    update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1024, 64]]}
    outside = http.post("/update_weights_from_distributed", json=update)
    assert outside.status_code == 400 and outside.json()["success"] is False
    assert "begin_weight_update" in outside.json()["message"]
    assert http.post("/end_weight_update", json={}).status_code == 400
    assert http.post("/begin_weight_update", json={}).json() == {"success": True, "message": "Success"}
    again = http.post("/begin_weight_update", json={})
    assert again.status_code == 400 and again.json()["success"] is False
    no_group = http.post("/update_weights_from_distributed", json=update)
    assert no_group.status_code == 400 and "init_weights_update_group" in no_group.json()["message"]
    assert http.post("/end_weight_update", json={}).status_code == 200
    gone = http.post("/destroy_weights_update_group", json={})
    assert gone.status_code == 400
    assert gone.json() == {"success": False, "message": "The group to be destroyed does not exist."}
    nccl = http.post(
        "/init_weights_update_group",
        json={"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1, "world_size": 2},
    )
    assert nccl.status_code == 400 and "gloo" in nccl.json()["message"]  # lax coercion: "29500" accepted


# ----- OpenAI routes -----------------------------------------------------------------------------------


def test_openai_completions_and_chat(http) -> None:
    comp = http.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "logprobs": 1, "temperature": 0}
    )
    body = comp.json()
    assert comp.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert body["metadata"]["weight_version"]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "logprobs": True},
    ).json()
    assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][1]["logprobs"]["content"]) == 3
    stream_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=stream_body) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wrong_type = http.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 400 and wrong_type.json()["type"] == "BadRequestError"
    bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["code"] == 400
