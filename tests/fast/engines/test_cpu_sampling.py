"""Sampling parameters and token choice of the CPU engine (pure)."""

from __future__ import annotations

import pytest
import torch

from miles.engines.cpu.sampling import (
    SamplingSchemaError,
    choose_token,
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
