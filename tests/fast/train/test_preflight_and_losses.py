"""Preflight validation, loss formulas on hand-computed values, and the DP share arithmetic (pure)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.errors import UserError
from miles.train import losses
from miles.train.dist import share_bounds
from miles.train.preflight import preflight
from miles.types import SUPPORTED_LOSSES, Datum

VOCAB, MAX_CONTEXT = 100, 16


def datum(n: int = 4, **overrides: np.ndarray) -> Datum:
    inputs = {
        "target_tokens": np.arange(1, n + 1, dtype=np.int64),
        "weights": np.ones(n, np.float32),
        "logprobs": np.full(n, -1.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    inputs.update(overrides)
    return Datum(np.arange(n, dtype=np.int64), inputs)


def check(data, loss_fn="ppo", config=None):
    return preflight(data, loss_fn, config or {}, vocab_size=VOCAB, max_context=MAX_CONTEXT)


def test_a_good_batch_passes_and_returns_the_loss() -> None:
    result = check([datum(), datum(7)], "ppo", {"clip_low_threshold": 0.7})
    assert result.loss.name == "ppo"
    assert result.loss_config == {"clip_low_threshold": 0.7}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            datum(target_tokens=np.arange(3, dtype=np.int64)),
            r"datum 1: loss_fn_inputs\['target_tokens'\] has length 3",
        ),
        (datum(advantages=np.ones(3, np.float32)), r"datum 1: loss_fn_inputs\['advantages'\] has length 3"),
        (
            Datum(np.arange(4), {"target_tokens": np.arange(4)}),
            r"datum 1: loss ppo needs .*missing \['logprobs'",
        ),
        (datum(target_tokens=np.ones(4, np.float32)), "datum 1: target_tokens must hold integer token ids"),
        (Datum(np.arange(4.0), datum().loss_fn_inputs), "datum 1: model_input must hold integer"),
        (datum(logprobs=np.zeros(4, np.int64)), r"datum 1: loss_fn_inputs\['logprobs'\] must be floating"),
        (datum(advantages=np.array([1, np.nan, 1, 1], np.float32)), "NaN or infinite"),
        (datum(target_tokens=np.array([1, 2, 3, VOCAB], np.int64)), r"token ids outside \[0, 100\)"),
        (Datum(np.array([-1, 0, 1, 2]), datum().loss_fn_inputs), r"model_input has token ids outside"),
        (datum(MAX_CONTEXT + 1), "more than the model's max context 16"),
        (datum(0), "datum 1: model_input is empty"),
        (
            Datum(np.arange(8).reshape(2, 4), datum().loss_fn_inputs),
            "model_input must be a 1-D integer array",
        ),
    ],
)
def test_each_problem_is_reported_with_the_datum_index(bad: Datum, message: str) -> None:
    with pytest.raises(UserError, match=message):
        check([datum(), bad, datum()])


def test_several_bad_datums_are_all_named() -> None:
    with pytest.raises(UserError, match=r"datum 0: .*; datum 2: "):
        check([datum(advantages=np.ones(2, np.float32)), datum(), datum(logprobs=np.ones(1, np.float32))])


def test_cross_entropy_needs_weights_but_not_advantages() -> None:
    ce = Datum(np.arange(3), {"target_tokens": np.arange(1, 4), "weights": np.ones(3, np.float32)})
    check([ce], "cross_entropy")
    with pytest.raises(UserError, match=r"missing \['logprobs', 'advantages'\]"):
        check([ce], "importance_sampling")


def test_unknown_loss_empty_batch_and_bad_config_are_refused() -> None:
    with pytest.raises(UserError, match="supported losses: " + ", ".join(SUPPORTED_LOSSES)):
        check([datum()], "dro")
    with pytest.raises(UserError, match="empty batch"):
        check([], "ppo")
    with pytest.raises(UserError, match=r"\['epsilon'\] are not used by ppo"):
        check([datum()], "ppo", {"epsilon": 0.2})
    with pytest.raises(UserError, match="not used by cross_entropy; allowed keys: none"):
        check([datum()], "cross_entropy", {"clip_low_threshold": 0.8})
    with pytest.raises(UserError, match="clip_low_threshold <= 1 <= clip_high_threshold"):
        check([datum()], "ppo", {"clip_low_threshold": 1.3})
    with pytest.raises(UserError, match="must be a number"):
        check([datum()], "ppo", {"clip_low_threshold": "0.8"})


def test_loss_formulas_on_hand_computed_values() -> None:
    lp = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.5)])
    old = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.5)])  # ratios 2, 0.5, 1
    adv = torch.tensor([1.0, 1.0, -2.0])
    inputs = {"weights": torch.tensor([1.0, 0.0, 2.0]), "logprobs": old, "advantages": adv}
    ce = losses.cross_entropy(lp, inputs, {})
    torch.testing.assert_close(ce, torch.tensor([math.log(2), 0.0, 2 * math.log(2)]))
    is_loss = losses.importance_sampling(lp, inputs, {})
    torch.testing.assert_close(is_loss, torch.tensor([-2.0, -0.5, 2.0]))
    # ratio 2 with A=1 clips to 1.2; ratio 0.5 with A=1: min(0.5, 0.8) = 0.5; ratio 1: -2
    ppo = losses.ppo(lp, inputs, {})
    torch.testing.assert_close(ppo, torch.tensor([-1.2, -0.5, 2.0]))
    narrow = losses.ppo(lp, inputs, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5})
    torch.testing.assert_close(narrow, torch.tensor([-1.5, -0.5, 2.0]))


@pytest.mark.parametrize(("n", "world"), [(5, 2), (2, 4), (8, 4), (0, 2), (7, 3)])
def test_shares_are_contiguous_complete_and_balanced(n: int, world: int) -> None:
    bounds = [share_bounds(n, world, rank) for rank in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1
