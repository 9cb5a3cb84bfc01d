"""Preflight validation, loss formulas on hand-computed values, and the DP share arithmetic (pure)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.contract.losses import LOSS_NAMES
from miles.errors import UserError
from miles.train import losses
from miles.train.dist import share_bounds
from miles.train.preflight import preflight
from miles.types import Datum

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
    with pytest.raises(UserError, match="supported losses: " + ", ".join(LOSS_NAMES)):
        check([datum()], "reinforce_plus_plus")
    with pytest.raises(UserError, match=r"loss dro needs loss_fn_config keys \['beta'\]"):
        check([datum()], "dro")
    with pytest.raises(UserError, match=r"loss_fn_config\['beta'\] must be >= 0"):
        check([datum()], "dro", {"beta": -0.1})
    with pytest.raises(UserError, match="cispo clip thresholds"):
        check([datum()], "cispo", {"clip_high_threshold": 0.5})
    with pytest.raises(
        UserError, match=r"\['beta'\] are not used by stable_reinforce; allowed keys: kl_coeff"
    ):
        check([datum()], "stable_reinforce", {"beta": 1.0})
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


def test_new_loss_formulas_on_hand_computed_values() -> None:
    lp = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.5)])
    old = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.5)])  # ratios 2, 0.5, 1
    adv = torch.tensor([1.0, 1.0, -2.0])
    inputs = {"logprobs": old, "advantages": adv}
    # cispo: weight clip(r, 0, 4) = r here, times logp * A, negated
    cispo = losses.cispo(lp, inputs, {})
    torch.testing.assert_close(cispo, -torch.tensor([2.0, 0.5, 1.0]) * lp * adv)
    capped = losses.cispo(lp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5})
    torch.testing.assert_close(capped, -torch.tensor([1.5, 0.8, 1.0]) * lp * adv)
    # dro: -(logp * A - beta/2 * (log r)^2)
    dro = losses.dro(lp, inputs, {"beta": 0.5})
    log2sq = math.log(2) ** 2
    torch.testing.assert_close(dro, -(lp * adv - 0.25 * torch.tensor([log2sq, log2sq, 0.0])))
    # gspo: the sequence ratio is the geometric mean exp(mean log r) = exp(0) = 1 over all three tokens;
    # masked to the first token it is 2, which A=1 clips to 1.2 and A=-2 does not (min picks 2 * -2)
    gspo = losses.gspo(lp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    torch.testing.assert_close(gspo, -adv)
    masked = {**inputs, "sequence_ratio_mask": torch.tensor([1.0, 0.0, 0.0])}
    gspo_masked = losses.gspo(lp, masked, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    torch.testing.assert_close(gspo_masked, torch.tensor([-1.2, -1.2, 4.0]))
    # stable_reinforce: -r * A + kl_coeff * ((r - 1) - log r)
    sr = losses.stable_reinforce(lp, inputs, {"kl_coeff": 0.5})
    penalty = torch.tensor([1.0 - math.log(2), -0.5 + math.log(2), 0.0])
    torch.testing.assert_close(sr, torch.tensor([-2.0, -0.5, 2.0]) + 0.5 * penalty)


def test_soft_targets_cross_entropy_sums_over_k() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.2]]))
    weights = torch.tensor([[0.75, 0.25], [-1.0, 0.5]])
    ce = losses.cross_entropy(lp, {"weights": weights}, {})
    torch.testing.assert_close(ce, -(weights * lp).sum(-1))


def soft_datum(n: int = 4, k: int = 3) -> Datum:
    targets = (np.arange(n * k, dtype=np.int64) % VOCAB).reshape(n, k)
    return Datum(
        np.arange(n, dtype=np.int64), {"target_tokens": targets, "weights": np.ones((n, k), np.float32)}
    )


def test_soft_targets_pass_preflight_only_for_cross_entropy_with_matching_shapes() -> None:
    check([soft_datum(), soft_datum(6)], "cross_entropy")
    bad_weights = soft_datum()
    bad_weights.loss_fn_inputs["weights"] = np.ones((4, 2), np.float32)
    with pytest.raises(UserError, match=r"datum 0: weights has shape \[4, 2\] but target_tokens \[4, 3\]"):
        check([bad_weights], "cross_entropy")
    flat_weights = soft_datum()
    flat_weights.loss_fn_inputs["weights"] = np.ones(4, np.float32)
    with pytest.raises(UserError, match=r"loss_fn_inputs\['weights'\] must be a 2-D float array"):
        check([flat_weights], "cross_entropy")
    rl = soft_datum()
    rl.loss_fn_inputs.update(logprobs=np.zeros(4, np.float32), advantages=np.ones(4, np.float32))
    with pytest.raises(UserError, match="target_tokens must be a 1-D integer array"):
        check([rl], "importance_sampling")
    with pytest.raises(UserError, match=r"target_tokens shapes differ across the batch \(1-D, K=3\)"):
        check([soft_datum(), datum()], "cross_entropy")
    with pytest.raises(UserError, match="K >= 1"):
        check([soft_datum(k=0)], "cross_entropy")


def test_sequence_ratio_mask_is_checked_when_given() -> None:
    check([datum(sequence_ratio_mask=np.array([0, 1, 1, 0], np.float32))], "gspo")
    with pytest.raises(UserError, match="sequence_ratio_mask marks no position"):
        check([datum(), datum(sequence_ratio_mask=np.zeros(4, np.float32))], "gspo")
    with pytest.raises(UserError, match=r"datum 0: loss_fn_inputs\['sequence_ratio_mask'\] has length 3"):
        check([datum(sequence_ratio_mask=np.ones(3, np.float32))], "gspo")


@pytest.mark.parametrize(("n", "world"), [(5, 2), (2, 4), (8, 4), (0, 2), (7, 3)])
def test_shares_are_contiguous_complete_and_balanced(n: int, world: int) -> None:
    bounds = [share_bounds(n, world, rank) for rank in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1
