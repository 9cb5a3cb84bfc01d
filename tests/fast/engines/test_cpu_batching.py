"""The CPU engine's step scheduler: concurrent requests share forwards (one decode forward per step for all
running rows) and every row gets what it would get alone (greedy tokens, logprobs within 1e-4, seeded
draws), through stops, aborts, pauses and adapters. Most tests drive an in-process Engine with the same
functions /generate uses, so they control exactly when requests arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.engines.cpu.engine import Engine
from miles.engines.cpu.generate import run_job
from miles.engines.cpu.requests import Phase
from miles.engines.cpu.server import build_jobs, run_to_end

PROMPTS = [[11, 42, 7, 99, 5], [3, 4], [100, 200, 300, 400, 500, 600, 700, 800, 900], [21, 8, 300, 44, 9, 10]]
GREEDY = {"temperature": 0, "ignore_eos": True}

MakeEngine = Callable[..., Coroutine[Any, Any, Engine]]


@pytest.fixture
async def make_engine(tiny_model_dir: Path) -> AsyncIterator[MakeEngine]:
    engines: list[Engine] = []

    async def make(max_running_requests: int = 256) -> Engine:
        engine = Engine(str(tiny_model_dir), max_running_requests=max_running_requests)
        await engine.load()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


async def _generate(engine: Engine, **body: Any) -> dict[str, Any]:
    jobs, _ = build_jobs(body, engine)
    assert len(jobs) == 1
    return await run_to_end(engine, jobs[0])


async def _alone(engine: Engine, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body on its own: the next starts when the previous finished."""
    return [await _generate(engine, **body) for body in bodies]


async def _together(engine: Engine, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(_generate(engine, **body) for body in bodies)))


def _logprobs(answer: dict[str, Any], key: str = "output_token_logprobs") -> list[float | None]:
    return [entry[0] for entry in answer["meta_info"][key]]


def _assert_same(batched: dict[str, Any], alone: dict[str, Any]) -> None:
    assert batched["output_ids"] == alone["output_ids"]
    assert batched["text"] == alone["text"]
    assert batched["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"]
    meta, ref = batched["meta_info"], alone["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in ref:
            got, want = _logprobs(batched, key), _logprobs(alone, key)
            assert [g is None for g in got] == [w is None for w in want]
            assert [g for g in got if g is not None] == pytest.approx(
                [w for w in want if w is not None], abs=1e-4
            )
    for key in ("output_top_logprobs", "input_top_logprobs"):
        if key in ref:
            assert [None if r is None else [t for _, t, _ in r] for r in meta[key]] == [
                None if r is None else [t for _, t, _ in r] for r in ref[key]
            ]


async def _wait_until(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


# ----- sharing forwards --------------------------------------------------------------------------------


async def test_concurrent_requests_decode_in_one_forward_per_step(make_engine) -> None:
    engine = await make_engine()
    bodies = [
        {"input_ids": PROMPTS[i % 4], "sampling_params": {**GREEDY, "max_new_tokens": 10}} for i in range(12)
    ]
    before = engine.scheduler.snapshot()
    answers = await _together(engine, bodies)
    after = engine.scheduler.snapshot()
    assert all(len(a["output_ids"]) == 10 for a in answers)
    # one prefill of all 12, then 9 decode steps of 12 rows (request by request: 12 x 10 forwards)
    assert after["forward_steps"] - before["forward_steps"] == 10
    assert after["decode_steps"] - before["decode_steps"] == 9
    assert after["max_batch_size"] == after["last_batch_size"] == 12
    assert after["num_running_reqs"] == 0 and after["num_queued_reqs"] == 0


async def test_max_running_requests_caps_the_rows_of_a_step(make_engine) -> None:
    engine = await make_engine(max_running_requests=3)
    bodies = [
        {"input_ids": PROMPTS[i % 4], "sampling_params": {**GREEDY, "max_new_tokens": 6}} for i in range(7)
    ]
    alone = await _alone(engine, bodies)
    batched = await _together(engine, bodies)
    for got, want in zip(batched, alone, strict=True):
        _assert_same(got, want)
    assert engine.scheduler.snapshot()["max_batch_size"] == 3


def test_server_info_reports_the_batching_counters(cpu_engine) -> None:
    with httpx.Client(base_url=cpu_engine.url, timeout=60) as http:
        before = http.get("/server_info").json()["internal_states"][0]
        body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 3}}
        assert http.post("/generate", json=body).status_code == 200
        after = http.get("/server_info").json()["internal_states"][0]
    assert before["max_running_requests"] == 256
    assert after["forward_steps"] - before["forward_steps"] == 3  # a lone request: prefill + 2 decodes
    assert after["last_batch_size"] == 1
    assert after["decode_mode"] == "slots"  # CPU: the fixed slots, eager
    eager = after["decode_counts"]["eager"] - before["decode_counts"]["eager"]
    assert eager == 2 and after["decode_counts"]["replays"] == 0


# ----- the same results as alone -----------------------------------------------------------------------


async def test_batched_rows_match_the_same_rows_alone(
    make_engine, reference_model, sequence_logprobs
) -> None:
    """Mixed prompt lengths (left padding), mixed max_new_tokens (the longest prompt ends first, so the
    batch drops it and cuts the padding it leaves), prompt and top logprobs, a stop string in one row."""
    engine = await make_engine()
    bodies: list[dict[str, Any]] = [
        {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 20}},
        {
            "input_ids": PROMPTS[1],
            "sampling_params": {**GREEDY, "max_new_tokens": 14},
            "return_logprob": True,
        },
        {
            "input_ids": PROMPTS[2],
            "sampling_params": {**GREEDY, "max_new_tokens": 3},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
        },
        {
            "input_ids": PROMPTS[3],
            "sampling_params": {**GREEDY, "max_new_tokens": 16, "min_new_tokens": 2},
            "return_logprob": True,
            "token_ids_logprob": [1, 5, 9],
        },
    ]
    alone = await _alone(engine, bodies)
    # a stop string taken from the middle of row 0's text: that row stops early, the others go on
    text = alone[0]["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), "the tiny model's text has a usable stop string"
    bodies[0]["sampling_params"] = {**GREEDY, "max_new_tokens": 20, "stop": [stop]}
    alone[0] = (await _alone(engine, bodies[:1]))[0]
    assert alone[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    batched = await _together(engine, bodies)
    for got, want in zip(batched, alone, strict=True):
        _assert_same(got, want)
    assert engine.scheduler.snapshot()["max_batch_size"] == 4
    # and both match the model itself, scored in one full forward
    expected = sequence_logprobs(reference_model, PROMPTS[1], batched[1]["output_ids"])
    assert _logprobs(batched[1]) == pytest.approx(expected, abs=1e-4)


async def test_a_request_joining_a_running_batch_matches_it_alone(make_engine) -> None:
    engine = await make_engine()
    early = [{"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 80}} for p in PROMPTS[:3]]
    late = {
        "input_ids": PROMPTS[3],
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
    }
    alone = await _alone(engine, [*early, late])
    running = asyncio.gather(*(_generate(engine, **body) for body in early))
    steps = engine.scheduler.stats.decode_steps
    await _wait_until(lambda: engine.scheduler.stats.decode_steps >= steps + 5)
    joined = await _generate(engine, **late)  # merged into the batch of 3 with 5+ tokens each
    for got, want in zip([*await running, joined], alone, strict=True):
        _assert_same(got, want)
    assert engine.scheduler.stats.max_batch_size == 4, "the late request joined the running batch"


async def test_a_seeded_request_draws_the_same_tokens_whatever_it_is_batched_with(make_engine) -> None:
    engine = await make_engine()
    seeded = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "top_k": 50, "sampling_seed": 7},
        "return_logprob": True,
    }
    hot = {"max_new_tokens": 30, "temperature": 1.3, "ignore_eos": True}
    (alone,) = await _alone(engine, [seeded])
    others = [{"input_ids": p, "sampling_params": hot} for p in PROMPTS[1:]]
    in_batch = await _together(engine, [*others, seeded])
    assert in_batch[-1]["output_ids"] == alone["output_ids"]
    # other company: seeded neighbours with other seeds, and joining a batch that already runs
    neighbours = [
        {**seeded, "sampling_params": {**seeded["sampling_params"], "sampling_seed": s}} for s in (1, 2)
    ]
    running = asyncio.gather(*(_generate(engine, **body) for body in [*others, *neighbours]))
    steps = engine.scheduler.stats.decode_steps
    await _wait_until(lambda: engine.scheduler.stats.decode_steps >= steps + 3)
    late = await _generate(engine, **seeded)
    await running
    assert late["output_ids"] == alone["output_ids"]
    assert _logprobs(late) == pytest.approx(_logprobs(alone), abs=1e-4)
    unseeded = await _together(engine, [{"input_ids": PROMPTS[0], "sampling_params": hot}] * 4)
    assert len({tuple(a["output_ids"]) for a in unseeded}) > 1, "unseeded rows draw independently"


async def test_streaming_reader_that_lags_still_gets_one_chunk_per_token(make_engine) -> None:
    engine = await make_engine()
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
    }
    jobs, _ = build_jobs(body, engine)
    other = asyncio.ensure_future(
        _generate(engine, input_ids=PROMPTS[1], sampling_params=body["sampling_params"])
    )
    counts = []
    async for state in run_job(engine, jobs[0]):
        counts.append((len(state.output_ids), len(state.output_logprobs), state.finish_reason is not None))
        await asyncio.sleep(0.01)  # the scheduler runs ahead meanwhile
    await other
    assert counts == [(n, n, n == 12) for n in range(1, 13)] + [(12, 12, True)]


# ----- aborts and pauses in a batch ---------------------------------------------------------------------


def _holding(engine: Engine, rid: str, tokens: int) -> Callable[[], bool]:
    """True once the row of `rid` has at least `tokens` output tokens."""

    def check() -> bool:
        rows = [r for g in engine.scheduler._groups.values() for r in g.rows if r.job.rid == rid]
        return bool(rows) and len(rows[0].state.output_ids) >= tokens

    return check


async def test_aborting_one_row_mid_batch_leaves_the_others_right(make_engine) -> None:
    engine = await make_engine()
    bodies = [
        {"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 100}, "rid": f"row-{i}"}
        for i, p in enumerate(PROMPTS)
    ]
    alone = await _alone(engine, bodies)
    together = asyncio.gather(*(_generate(engine, **body) for body in bodies))
    await _wait_until(_holding(engine, "row-2", 5))
    await engine.abort("row-2")
    answers = await together
    victim = answers.pop(2)
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(victim["output_ids"]) < 100
    assert victim["output_ids"] == alone[2]["output_ids"][: len(victim["output_ids"])]
    for got, want in zip(answers, alone[:2] + alone[3:], strict=True):
        _assert_same(got, want)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pausing_a_batch_mid_way_then_continuing_gives_the_same_greedy_result(
    make_engine, mode
) -> None:
    engine = await make_engine()
    bodies = [
        {
            "input_ids": p,
            "sampling_params": {**GREEDY, "max_new_tokens": 60},
            "rid": f"row-{i}",
            "return_logprob": True,
        }
        for i, p in enumerate(PROMPTS)
    ]
    alone = await _alone(engine, bodies)
    together = asyncio.gather(*(_generate(engine, **body) for body in bodies))
    await _wait_until(_holding(engine, "row-0", 6))
    await engine.pause(mode)
    assert engine.count(frozenset({Phase.RUNNING})) == 0
    held = engine.scheduler.snapshot()["num_running_reqs"]
    if mode == "retract":  # every row's KV dropped: the cache can be flushed
        assert held == 0 and engine.flush_refusal() is None
        assert engine.count(frozenset({Phase.RETRACTED})) == 4
    else:
        assert held == 4 and engine.flush_refusal() is not None
    steps = engine.scheduler.stats.forwards
    await asyncio.sleep(0.1)
    assert engine.scheduler.stats.forwards == steps, "a paused batch takes no steps"
    await engine.resume()
    answers = await together
    for got, want in zip(answers, alone, strict=True):
        _assert_same(got, want)
        assert got["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


async def test_a_weight_update_waits_for_the_running_batch(make_engine) -> None:
    engine = await make_engine()
    params = {**GREEDY, "max_new_tokens": 30}
    jobs = [build_jobs({"input_ids": p, "sampling_params": params}, engine)[0][0] for p in PROMPTS]
    finals: list[Any] = []

    async def run(job: Any) -> None:
        states = [state async for state in run_job(engine, job)]
        finals.append(states[-1])

    together = asyncio.gather(*(run(job) for job in jobs))
    await _wait_until(lambda: engine.scheduler.stats.decode_steps >= 3)
    async with engine.exclusive_weights():
        states = [r.state for g in engine.scheduler._groups.values() for r in g.rows] + finals
        assert len(states) == 4, "every row finished or still known to the scheduler"
        assert all(len(s.output_ids) == 30 and s.finish_reason is not None for s in states)
    await together


# ----- adapters -----------------------------------------------------------------------------------------


def _save_adapter(tiny_model_dir: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(str(out))
    return out


async def test_rows_with_different_adapters_step_in_their_own_forwards(
    make_engine, tiny_model_dir, tmp_path
) -> None:
    engine = await make_engine()
    await engine.load_adapter("a", str(_save_adapter(tiny_model_dir, tmp_path / "a", 1)))
    await engine.load_adapter("b", str(_save_adapter(tiny_model_dir, tmp_path / "b", 2)))
    params = {**GREEDY, "max_new_tokens": 8}
    rows = [(prompt, lora) for prompt in PROMPTS[:2] for lora in (None, "a", "b")]  # arrivals interleaved
    bodies = [
        {"input_ids": prompt, "sampling_params": params, "lora_path": lora, "return_logprob": True}
        for prompt, lora in rows
    ]
    alone = await _alone(engine, bodies)
    before = engine.scheduler.snapshot()
    batched = await _together(engine, bodies)
    after = engine.scheduler.snapshot()
    for got, want in zip(batched, alone, strict=True):
        _assert_same(got, want)
    base, with_a, with_b = (_logprobs(answer) for answer in batched[:3])  # one prompt, three weights
    assert with_a != pytest.approx(base, abs=1e-3) and with_b != pytest.approx(with_a, abs=1e-3)
    # three adapters (base included): 3 prefills + 3 x 7 decode steps of 2 rows each
    assert after["decode_steps"] - before["decode_steps"] == 21
    assert after["max_batch_size"] == 2
