"""stable_reinforce provenance: recorded sampler logprobs overlaid on a datum's sampled runs (pure part)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.errors import UserError
from miles.gateway.services.stability import overlay
from miles.gateway.tinker.codec import LossSpan
from miles.types import Datum

SEQ = "req-1:0"
SAMPLED = (np.array([40, 41, 42, 43], np.int64), np.array([-0.1, -0.2, -0.3, -0.4], np.float32))


def datum(targets: list[int]) -> Datum:
    n = len(targets)
    inputs = {
        "target_tokens": np.asarray(targets, np.int64),
        "logprobs": np.full(n, -9.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    return Datum(np.arange(n, dtype=np.int64), inputs)


def test_sampled_runs_take_the_recorded_logprobs_and_prompt_runs_keep_the_clients() -> None:
    spans = [LossSpan(SEQ, 1, 1, sampled=False), LossSpan(SEQ, 1, 2, sampled=True)]
    out = overlay(datum([7, 41, 42]), spans, {SEQ: SAMPLED})
    np.testing.assert_array_equal(out.loss_fn_inputs["logprobs"], np.array([-9.0, -0.2, -0.3], np.float32))
    assert out.loss_fn_inputs["advantages"] is not None


@pytest.mark.parametrize(
    ("targets", "spans", "message"),
    [
        ([41, 42], [LossSpan(SEQ, 1, 1, sampled=True)], "cover 1 positions but target_tokens has 2"),
        ([42, 43, 44], [LossSpan(SEQ, 2, 3, sampled=True)], r"span \[2, 5\) of sequence req-1:0 is past"),
        ([41, 99], [LossSpan(SEQ, 1, 2, sampled=True)], r"target_tokens\[0:2\] are not the tokens sampled"),
    ],
)
def test_bad_provenance_is_a_user_error(targets: list[int], spans: list[LossSpan], message: str) -> None:
    with pytest.raises(UserError, match=message):
        overlay(datum(targets), spans, {SEQ: SAMPLED})


def test_a_datum_missing_logprobs_is_left_for_preflight_to_name() -> None:
    bare = Datum(np.arange(2), {"target_tokens": np.array([41, 42])})
    assert overlay(bare, [LossSpan(SEQ, 1, 2, sampled=True)], {SEQ: SAMPLED}) is bare
