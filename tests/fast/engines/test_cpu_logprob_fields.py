"""SGLang's logprob request fields on the CPU engine (`top_logprobs_num`, `token_ids_logprob`,
`logprob_start_len`), Tinker's logprob options mapped onto them (miles.rollout.sampling), and streaming;
every value against logprobs computed directly from the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.engines.cpu.requests import Phase
from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.sampling import sample_on_engine, stream_on_engine
from miles.types import LogprobSpec, SamplingParams
from miles.utils.http import close_clients

PROMPT = [11, 42, 7, 99, 5, 23]


@pytest.fixture
async def client(cpu_engine):
    yield SGLangApiClient(cpu_engine.url)
    await close_clients()


@pytest.fixture(scope="module")
def logprobs_of(reference_model):
    """`fn(ids)`: the model's [len(ids), vocab] next-token logprobs (row i predicts ids[i + 1])."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(reference_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def _top(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = torch.topk(row, k)
    return [(int(i), float(v)) for v, i in zip(values, ids, strict=True)]


def _as_pairs(entries: list[list]) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for lp, t, _ in entries]


# ----- SGLang's fields on the engine -------------------------------------------------------------------


async def test_top_logprobs_num_reports_input_and_output_rows_like_sglang(client, logprobs_of) -> None:
    start = 2
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 3, "temperature": 0},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=4,
    )
    meta = out["meta_info"]
    reference = logprobs_of(PROMPT + out["output_ids"])
    inputs = meta["input_top_logprobs"]
    # SGLang: one row per position from the start; the start position's own row is None
    assert len(inputs) == len(PROMPT) - start and inputs[0] is None
    for position, row in zip(range(start + 1, len(PROMPT)), inputs[1:], strict=True):
        got, expected = _as_pairs(row), _top(reference[position - 1], 4)
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    outputs = meta["output_top_logprobs"]
    assert len(outputs) == len(out["output_ids"])
    for i, row in enumerate(outputs):
        expected = _top(reference[len(PROMPT) - 1 + i], 4)
        assert _as_pairs(row)[0][0] == out["output_ids"][i]  # greedy: the top-1 was sampled
        assert [lp for _, lp in _as_pairs(row)] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    # input_token_logprobs follow the same rule: the start position itself is None
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_token_logprobs"][1][0] == pytest.approx(
        float(reference[start, PROMPT[start + 1]]), abs=1e-4
    )


async def test_token_ids_logprob_scores_the_same_ids_at_every_position(client, logprobs_of) -> None:
    ids = [3, 17, 250]
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        token_ids_logprob=ids,
    )
    meta = out["meta_info"]
    reference = logprobs_of(PROMPT + out["output_ids"])
    rows = meta["input_token_ids_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        got = _as_pairs(rows[position])
        assert [t for t, _ in got] == ids  # in the order asked
        assert [lp for _, lp in got] == pytest.approx(
            [float(reference[position - 1, t]) for t in ids], abs=1e-4
        )
    assert len(meta["output_token_ids_logprobs"]) == 2
    assert [lp for _, lp in _as_pairs(meta["output_token_ids_logprobs"][1])] == pytest.approx(
        [float(reference[len(PROMPT), t]) for t in ids], abs=1e-4
    )


async def test_a_batch_takes_per_item_sampling_params_and_answers_item_major(client) -> None:
    params = [{"max_new_tokens": 1, "temperature": 1.0, "sampling_seed": s} for s in (1, 2, 1)]
    out = await client.generate(input_ids=[PROMPT[:2], PROMPT[:3], PROMPT[:2]], sampling_params=params)
    assert isinstance(out, list) and len(out) == 3
    assert out[0]["output_ids"] == out[2]["output_ids"]  # same prefix, same seed


async def test_generate_stream_yields_tokens_while_the_request_runs(client, cpu_engine) -> None:
    """The first chunk arrives while the request still runs: pausing in place right after it finds the
    request parked mid-generation (had the engine answered only at the end, nothing would be running)."""
    engine = cpu_engine.app.state.engine
    counts: list[int] = []
    stream = client.generate_stream(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
    )
    async for chunk in stream:
        counts.append(len(chunk["output_ids"]))
        assert len(chunk["meta_info"]["output_token_logprobs"]) == len(chunk["output_ids"])
        if len(counts) == 1:
            await client.pause_generation("in_place")
            parked = engine.count(frozenset({Phase.PAUSED_IN_PLACE}))
            await client.continue_generation()
            assert parked == 1, "the first chunk came after the generation had finished"
    assert counts == list(range(1, 401))  # cumulative chunks, one per token, as SGLang sends them
    assert chunk["meta_info"]["finish_reason"]["type"] == "length"


# ----- Tinker's options through the rollout mapping ----------------------------------------------------


async def test_every_tinker_logprob_option_matches_the_model(client, logprobs_of) -> None:
    target = np.full((len(PROMPT) - 1, 3), -1, dtype=np.int64)
    target[2] = [4, 60, -1]  # rows 0-1 name nothing: not scored
    target[4] = [PROMPT[5], 9, 4]
    spec = LogprobSpec(prompt=True, prompt_last_n=2, topk_prompt=3, topk_sample=2, target_prompt=target)
    params = SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=(), stop_strings=())
    out = await sample_on_engine(client, PROMPT, params, num_samples=2, logprobs=spec)
    reference = logprobs_of(PROMPT)
    n = len(PROMPT)
    assert out.prompt_logprobs[: n - 2] == [None] * (n - 2)
    assert out.prompt_logprobs[n - 2 :] == pytest.approx(
        [float(reference[p - 1, PROMPT[p]]) for p in range(n - 2, n)], abs=1e-4
    )
    assert out.topk_prompt[: n - 2] == [None] * (n - 2)
    for p in range(n - 2, n):
        assert [t for t, _ in out.topk_prompt[p]] == [t for t, _ in _top(reference[p - 1], 3)]
    expected = np.zeros(target.shape, dtype=np.float32)
    for r, c in zip(*np.nonzero(target >= 0), strict=True):
        expected[r, c] = float(reference[r, target[r, c]])  # row r scores position r + 1
    np.testing.assert_allclose(out.target_prompt, expected, atol=1e-4)
    for seq in out.sequences:
        full = logprobs_of(PROMPT + seq.tokens)
        assert len(seq.topk) == len(seq.tokens)
        for i, row in enumerate(seq.topk):
            expected_row = _top(full[n - 1 + i], 2)
            assert [t for t, _ in row] == [t for t, _ in expected_row]
            assert [lp for _, lp in row] == pytest.approx([lp for _, lp in expected_row], abs=1e-4)


async def test_alt_tokens_are_draws_with_the_models_logprobs(client, logprobs_of) -> None:
    reference = logprobs_of(PROMPT)
    greedy = await sample_on_engine(
        client,
        PROMPT,
        SamplingParams(max_tokens=1, temperature=0.0),
        num_samples=1,
        logprobs=LogprobSpec(alt_tokens_k=2),
    )
    argmax = [int(torch.argmax(reference[p - 1])) for p in range(1, len(PROMPT))]
    assert greedy.alt_tokens.shape == (len(PROMPT) - 1, 2)
    assert greedy.alt_tokens.tolist() == [[t, t] for t in argmax]  # temperature 0: every draw is the mode
    seeded = SamplingParams(max_tokens=1, temperature=1.5, seed=7)
    first = await sample_on_engine(
        client, PROMPT, seeded, num_samples=1, logprobs=LogprobSpec(alt_tokens_k=4)
    )
    again = await sample_on_engine(
        client, PROMPT, seeded, num_samples=1, logprobs=LogprobSpec(alt_tokens_k=4)
    )
    assert first.alt_tokens.tolist() == again.alt_tokens.tolist()
    assert len(set(first.alt_tokens.reshape(-1).tolist())) > 1  # hot draws differ
    for r, c in np.ndindex(first.alt_tokens.shape):
        assert first.alt_logprobs[r, c] == pytest.approx(
            float(reference[r, first.alt_tokens[r, c]]), abs=1e-4
        )


async def test_stream_on_engine_merges_n_sequences_into_the_full_samples(client) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop_token_ids=(), stop_strings=())
    whole = await sample_on_engine(client, PROMPT, params, num_samples=2, logprobs=LogprobSpec())
    tokens: dict[int, list[int]] = {0: [], 1: []}
    stops: dict[int, str] = {}
    async for chunk in stream_on_engine(client, PROMPT, params, num_samples=2):
        assert chunk.index not in stops, "a chunk after the sequence's last one"
        tokens[chunk.index] += chunk.tokens
        if chunk.stop_reason is not None:
            stops[chunk.index] = chunk.stop_reason
    assert [tokens[0], tokens[1]] == [s.tokens for s in whole.sequences]  # same seeds, same samples
    assert stops == {0: "length", 1: "length"}
