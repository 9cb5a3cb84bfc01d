"""Sampling parameters and token choice of the CPU engine (pure)."""

from __future__ import annotations

import pytest
import torch

from miles.engines.cpu.sampling import (
    SamplingSchemaError,
    choose_token,
    choose_tokens,
    make_generator,
    parse_sampling_params,
)


def test_defaults_and_aliases() -> None:
    cfg = parse_sampling_params({"stop": "x", "sampling_seed": 3, "top_k": 5})
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.n) == (128, 1.0, 1.0, 1)
    assert cfg.stop == ("x",) and cfg.seed == 3 and cfg.top_k == 5


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ({"max_tokens": 3}, SamplingSchemaError, "unknown field"),
        ({"temperature": -1}, ValueError, "temperature"),
        ({"top_p": 0}, ValueError, "top_p"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"n": 0}, ValueError, "n must be"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, ValueError, "min_new_tokens"),
        ({"regex": "a+"}, ValueError, "not supported"),
    ],
)
def test_bad_params_say_what_to_fix(params, error, match) -> None:
    with pytest.raises(error, match=match):
        parse_sampling_params(params)


def test_logprob_is_of_the_sampled_token_under_the_raw_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    raw = torch.log_softmax(logits, dim=-1)
    cfg = parse_sampling_params({"temperature": 5.0})
    seen = set()
    gen = make_generator(0)
    for _ in range(200):
        token, logprob = choose_token(logits, cfg, gen)
        seen.add(token)
        assert logprob == pytest.approx(float(raw[token]))
    assert len(seen) > 1, "a hot temperature must sample more than the top-1 token"


def test_greedy_top_k_and_top_p_restrict_the_choice() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, -5.0])
    assert choose_token(logits, parse_sampling_params({"temperature": 0}), make_generator(0))[0] == 0
    gen = make_generator(1)
    top2 = parse_sampling_params({"top_k": 2})
    assert {choose_token(logits, top2, gen)[0] for _ in range(200)} == {0, 1}
    # p = [0.36, 0.33, 0.30, ~0]: top_p 0.5 keeps the first two only
    top_p = parse_sampling_params({"top_p": 0.5})
    assert {choose_token(logits, top_p, gen)[0] for _ in range(200)} == {0, 1}


def test_same_seed_same_tokens() -> None:
    logits = torch.zeros(50)
    cfg = parse_sampling_params({})
    a = [choose_token(logits, cfg, g)[0] for g in [make_generator(7)] for _ in range(20)]
    b = [choose_token(logits, cfg, g)[0] for g in [make_generator(7)] for _ in range(20)]
    assert a == b


def test_choose_tokens_draws_seeded_rows_as_choose_token_would_alone() -> None:
    """In a batch, a seeded row's draws depend on its own generator only (not on its neighbours), greedy rows
    take the argmax, unseeded rows of one config draw together, and every logprob is the raw one."""
    torch.manual_seed(0)
    hot = parse_sampling_params({"temperature": 1.5, "top_k": 40})
    nucleus = parse_sampling_params({"temperature": 0.9, "top_p": 0.8})
    greedy = parse_sampling_params({"temperature": 0})
    cfgs = [hot, greedy, nucleus, hot, hot, nucleus]
    seeds = [11, None, 12, None, 13, None]
    gens = [make_generator(s) if s is not None else None for s in seeds]
    alone = {row: make_generator(seeds[row]) for row in (0, 2, 4)}
    shared = make_generator(0)
    unseeded: set[tuple[int, int]] = set()
    for _ in range(30):
        logits = torch.randn(6, 64) * 3
        tokens, logprobs = choose_tokens(logits, cfgs, gens, shared)
        for row, gen in alone.items():
            assert tokens[row] == choose_token(logits[row], cfgs[row], gen)[0]
        assert tokens[1] == int(torch.argmax(logits[1]))
        raw = torch.log_softmax(logits, dim=-1)
        assert logprobs == pytest.approx([float(raw[r, t]) for r, t in enumerate(tokens)])
        unseeded.add((tokens[3], tokens[5]))
    assert len(unseeded) > 1
