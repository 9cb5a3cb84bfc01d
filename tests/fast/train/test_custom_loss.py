"""Server-side custom losses: graphs traced and encoded by the real tinker SDK, checked by the contract,
run by the trainer's interpreter, refused in the whole-batch preflight."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from miles.contract.custom_loss import (
    ALLOWED_FUNCTIONS,
    ALLOWED_METHODS,
    CUSTOM_LOSS,
    CustomLossProgram,
    CustomLossRefused,
    program_from_request,
)
from miles.errors import UserError
from miles.train.backends.compute import forward_backward_output, score_datum
from miles.train.custom_loss import FUNCTIONS, METHODS, CustomLoss, dry_run_problems, extreme_signatures
from miles.train.losses import sum_metrics
from miles.train.preflight import preflight
from miles.types import Datum

VOCAB = 100


def dpo_like(logprobs, weights, ref_logprob, sign):
    policy = (logprobs * weights).sum()
    margin = 0.1 * sign * (policy - ref_logprob)
    loss = -F.logsigmoid(margin)
    return loss, {"custom/accuracy:mean": (margin > 0).float(), "custom/margin:sum": margin.detach()}


DPO_RANKS = {"logprobs": 1, "weights": 1, "ref_logprob": 0, "sign": 0}


def masked_mean(logprobs, mask):
    n = logprobs.shape[0]
    chosen = logprobs[mask > 0]
    loss = -chosen.sum() / n + torch.clamp(logprobs, min=-5.0)[1:].exp().mean() * 0.0
    return loss, {"custom/selected:sum": (mask > 0).float().sum()}


def soft_targets(logprobs, weights):
    probs = torch.softmax(logprobs, dim=-1)
    loss = -(weights * logprobs).sum() + 0.5 * torch.logsumexp(logprobs, dim=-1).mean()
    return loss, {"custom/entropy:mean": -(probs * logprobs).sum(-1).mean()}


def program(fn: Callable[..., Any], ranks: dict[str, int]) -> CustomLossProgram:
    """`fn` as the SDK sends it, then checked as the gateway checks it."""
    handle = trace_loss(fn, ranks, "session")
    inputs = [item.model_dump() for item in handle.inputs]
    return program_from_request(handle.name, inputs, encode_graph(handle).model_dump())


def raw(fn: Callable[..., Any], ranks: dict[str, int]) -> dict[str, Any]:
    """The SDK's request fields, unchecked (to be edited into something the server must refuse)."""
    handle = trace_loss(fn, ranks, "session")
    return {
        "name": handle.name,
        "inputs": [item.model_dump() for item in handle.inputs],
        "graph": encode_graph(handle).model_dump(),
    }


def dpo_datum(length: int, seed: int, sign: float = 1.0) -> Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, length + 1)
    inputs = {
        "target_tokens": tokens[1:],
        "weights": (rng.random(length) > 0.3).astype(np.float32),
        "ref_logprob": np.asarray(-3.0 * length, np.float32),
        "sign": np.asarray(sign, np.float32),
    }
    return Datum(tokens[:-1], inputs)


def check(data: list[Datum], config: dict[str, Any]):
    return preflight(data, CUSTOM_LOSS, config, vocab_size=VOCAB, max_context=64)


def test_the_trainers_tables_are_the_contracts_allow_list() -> None:
    assert set(FUNCTIONS) == ALLOWED_FUNCTIONS
    assert set(METHODS) == ALLOWED_METHODS


@pytest.mark.parametrize(
    ("fn", "ranks", "shape", "inputs"),
    [
        (
            dpo_like,
            DPO_RANKS,
            (6,),
            {"weights": torch.rand(6), "ref_logprob": torch.tensor(-2.0), "sign": torch.tensor(-1.0)},
        ),
        (masked_mean, {"logprobs": 1, "mask": 1}, (5,), {"mask": torch.tensor([1, 0, 1, 1, 0])}),
        (soft_targets, {"logprobs": 2, "weights": 2}, (4, 3), {"weights": torch.rand(4, 3)}),
    ],
)
def test_the_interpreter_gives_the_functions_loss_metrics_and_gradient(fn, ranks, shape, inputs) -> None:
    loss = CustomLoss(program(fn, ranks))
    logprobs = (-torch.rand(shape) * 3).requires_grad_()
    out = loss(logprobs, inputs)
    out.loss.backward()
    ours = logprobs.grad.clone()
    logprobs.grad = None
    want, want_metrics = fn(logprobs, *inputs.values())
    want.backward()
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(ours, logprobs.grad)
    assert out.metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        torch.testing.assert_close(out.metrics[key], value.reshape(()))


def _edit(request: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    edited = copy.deepcopy(request)
    edited["graph"]["nodes"][index].update(changes)
    return edited


def _node(request: dict[str, Any], target: str) -> int:
    return next(i for i, n in enumerate(request["graph"]["nodes"]) if n["target"] == target)


def test_the_gateway_check_refuses_what_the_allow_list_lacks_and_names_it() -> None:
    request = raw(dpo_like, DPO_RANKS)
    exp = _node(request, "operator.mul")

    def refused(edited: dict[str, Any]) -> str:
        with pytest.raises(CustomLossRefused) as info:
            program_from_request(**edited)
        return str(info.value)

    assert "'os.system'" in refused(_edit(request, exp, target="os.system"))
    assert "'torch._C._nn.gelu'" in refused(_edit(request, exp, target="torch._C._nn.gelu"))
    sum_node = _node(request, "sum")
    assert "method 'gather'" in refused(_edit(request, sum_node, target="gather"))
    assert "method '__reduce__'" in refused(_edit(request, sum_node, target="__reduce__"))
    assert "get_attr" in refused(_edit(request, exp, op="get_attr", target="weight"))
    assert "call_module" in refused(_edit(request, exp, op="call_module", target="linear"))
    assert "'later'" in refused(_edit(request, exp, args=[{"ref": "later"}, 1.0]))
    assert "device argument" in refused(_edit(request, exp, args=[{"ref": "logprobs"}, {"device": "cuda:0"}]))
    assert "dtype 'complex64'" in refused(
        _edit(request, exp, args=[{"ref": "logprobs"}, {"dtype": "complex64"}])
    )
    out = len(request["graph"]["nodes"]) - 1
    bad_metric = {"tuple": [{"ref": "neg"}, {"dict": {"accuracy": {"ref": "neg"}}}]}
    assert "metric 'accuracy'" in refused(_edit(request, out, args=[bad_metric]))
    swapped = copy.deepcopy(request)
    swapped["inputs"][1], swapped["inputs"][2] = swapped["inputs"][2], swapped["inputs"][1]
    assert "placeholders" in refused(swapped)
    with pytest.raises(CustomLossRefused, match="format 2"):
        program_from_request(request["name"], request["inputs"], {**request["graph"], "format": 2})


def test_getattr_reads_only_shape_ndim_and_dtype() -> None:
    request = raw(masked_mean, {"logprobs": 1, "mask": 1})
    shape = _node(request, "getattr")
    with pytest.raises(CustomLossRefused, match="__class__"):
        program_from_request(**_edit(request, shape, args=[{"ref": "logprobs"}, "__class__"]))


def test_preflight_refuses_inputs_that_do_not_fit_the_declared_ones() -> None:
    config = {"program": program(dpo_like, DPO_RANKS).model_dump(mode="json")}
    good = [dpo_datum(5, 0), dpo_datum(7, 1, sign=-1.0)]
    checked = check(good, config)
    assert checked.loss.custom is not None and checked.loss_config == {}

    missing = dpo_datum(5, 2)
    del missing.loss_fn_inputs["sign"]
    with pytest.raises(UserError, match=r"datum 1: .*loss_fn_inputs\['sign'\]"):
        check([good[0], missing], config)
    short = dpo_datum(5, 3)
    short.loss_fn_inputs["weights"] = short.loss_fn_inputs["weights"][:3]
    with pytest.raises(UserError, match="has 3 rows but target_tokens has 5"):
        check([short], config)
    ranked = dpo_datum(5, 4)
    ranked.loss_fn_inputs["sign"] = np.ones(5, np.float32)
    with pytest.raises(UserError, match=r"'sign'\] has rank 1, but .* declared rank 0"):
        check([ranked], config)
    with pytest.raises(UserError, match="create_custom_loss"):
        check(good, {"loss_id": "s:loss:0"})
    with pytest.raises(UserError, match="program is malformed"):
        check(good, {"program": {"name": "x", "inputs": [], "nodes": []}})


def _refused_at_preflight(fn: Callable[..., Any], ranks: dict[str, int], match: str) -> None:
    config = {"program": program(fn, ranks).model_dump(mode="json")}
    datum = dpo_datum(6, 0)
    datum.loss_fn_inputs["mask"] = np.ones(6, np.float32)
    with pytest.raises(UserError, match=match):
        check([datum], config)


def test_preflight_runs_the_graph_on_meta_tensors_and_refuses_what_would_fail() -> None:
    def not_scalar(logprobs, mask):
        return logprobs * mask, {}

    def no_gradient(logprobs, mask):
        return mask.sum(), {}

    def grows(logprobs, mask):
        x = logprobs
        for _ in range(24):
            x = torch.cat([x, x])
        return x.sum(), {}

    def broadcast_error(logprobs, mask):
        return (logprobs + mask[1:]).sum(), {}

    def indexes_by_tensor(logprobs, mask):
        return logprobs[mask.to(torch.int64)].sum(), {}

    def huge_power(logprobs, mask):
        return logprobs.sum() * (logprobs.shape[0] ** 100000), {}

    def squares_forever(logprobs, mask):
        n = logprobs.shape[0]
        for _ in range(10):
            n = n * n
        return logprobs.sum() * n, {}

    ranks = {"logprobs": 1, "mask": 1}
    _refused_at_preflight(not_scalar, ranks, "must return a floating-point scalar loss, got \\(6,\\)")
    _refused_at_preflight(no_gradient, ranks, "does not depend on logprobs")
    _refused_at_preflight(grows, ranks, "over this datum's cap")
    _refused_at_preflight(broadcast_error, ranks, r"node 'add' \(operator.add\) failed")
    _refused_at_preflight(indexes_by_tensor, ranks, "not by a tensor of indices")
    _refused_at_preflight(huge_power, ranks, "to the power 100000")
    _refused_at_preflight(squares_forever, ranks, "beyond int64")


def test_score_datum_spreads_the_loss_and_the_batch_combines_metrics_as_the_sdk_does() -> None:
    checked = check([dpo_datum(4, 0)], {"program": program(dpo_like, DPO_RANKS).model_dump(mode="json")})
    data = [dpo_datum(4, 0), dpo_datum(6, 1, sign=-1.0), dpo_datum(3, 2)]
    results, losses, metrics = [], [], []
    for datum in data:
        logprobs = torch.full((len(datum.model_input),), -0.5)
        total, result = score_datum(datum, logprobs, checked.loss, {}, torch.device("cpu"))
        inputs = [torch.as_tensor(datum.loss_fn_inputs[k]) for k in ("weights", "ref_logprob", "sign")]
        want, want_metrics = dpo_like(logprobs, *inputs)
        torch.testing.assert_close(total, want)
        np.testing.assert_allclose(result.elementwise_loss.sum(), float(want), rtol=1e-6)
        assert result.elementwise_loss.shape == (len(datum.model_input),)
        results.append(result)
        losses.append(float(want))
        metrics.append({k: float(v) for k, v in want_metrics.items()})
    out = forward_backward_output(results)
    assert out.metrics["loss:sum"] == pytest.approx(sum(losses), rel=1e-6)
    accuracy = [m["custom/accuracy:mean"] for m in metrics]
    assert 0 < sum(accuracy) < len(accuracy)  # a mean that differs from the sum
    assert out.metrics["custom/accuracy:mean"] == pytest.approx(np.mean(accuracy))
    assert out.metrics["custom/margin:sum"] == pytest.approx(
        sum(m["custom/margin:sum"] for m in metrics), rel=1e-5
    )


def test_parts_of_a_batch_merge_means_by_datum_count() -> None:
    merged = sum_metrics(
        [({"loss:sum": 2.0, "custom/a:mean": 1.0}, 1), ({"loss:sum": 3.0, "custom/a:mean": 0.0}, 3)]
    )
    assert merged == {"loss:sum": 5.0, "custom/a:mean": 0.25}


def test_python_arithmetic_on_strings_is_refused_before_it_can_fill_memory() -> None:
    request = raw(dpo_like, DPO_RANKS)
    scale = _node(request, "operator.mul")
    edited = _edit(request, scale, args=["x", 10**12])  # "x" * 10**12: a terabyte string
    config = {
        "program": program_from_request(**edited).model_dump(mode="json")
    }  # data, so the gateway keeps it
    with pytest.raises(UserError, match="takes tensors and numbers, not 'x'"):
        check([dpo_datum(5, 0)], config)


def test_masks_inside_index_tuples_pass_the_meta_run_and_wrong_shapes_do_not() -> None:
    def first_choice(logprobs, mask):  # rank-2 logprobs: the first of K targets at the masked positions
        return -logprobs[mask > 0, 0].sum(), {}

    def misaligned(logprobs, mask):
        return -logprobs[mask[1:] > 0, 0].sum(), {}

    rng = np.random.default_rng(0)
    datum = Datum(
        rng.integers(0, VOCAB, 6),
        {"target_tokens": rng.integers(0, VOCAB, (6, 3)), "mask": np.asarray([1, 0, 1, 1, 0, 1], np.float32)},
    )
    ranks = {"logprobs": 2, "mask": 1}
    checked = check([datum], {"program": program(first_choice, ranks).model_dump(mode="json")})
    logprobs = -torch.rand(6, 3)
    total, _ = score_datum(datum, logprobs, checked.loss, {}, torch.device("cpu"))
    torch.testing.assert_close(
        total, first_choice(logprobs, torch.as_tensor(datum.loss_fn_inputs["mask"]))[0]
    )
    with pytest.raises(UserError, match=r"a mask of shape \[5\] cannot index dimensions \[6\]"):
        check([datum], {"program": program(misaligned, ranks).model_dump(mode="json")})


def test_the_meta_run_takes_the_shortest_and_longest_of_each_shape_family() -> None:
    loss = CustomLoss(program(soft_targets, {"logprobs": 2, "weights": 2}))
    f32 = torch.float32
    signatures = {((n, k), (("weights", (n, k), f32),)) for n in range(1, 30) for k in (2, 3)}
    assert sorted(extreme_signatures(signatures)) == sorted(
        [((1, 2), (("weights", (1, 2), f32),)), ((29, 2), (("weights", (29, 2), f32),)),
         ((1, 3), (("weights", (1, 3), f32),)), ((29, 3), (("weights", (29, 3), f32),))]
    )  # fmt: skip
    assert dry_run_problems(loss, extreme_signatures(signatures)) is None

    def needs_five(logprobs, mask):
        return -logprobs[4], {}

    rng = np.random.default_rng(1)
    data = []
    for length in (9, 3, 7):  # the datum too short for the graph is neither first nor last
        tokens = rng.integers(0, VOCAB, length + 1)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "mask": np.ones(length, np.float32)}))
    config = {"program": program(needs_five, {"logprobs": 1, "mask": 1}).model_dump(mode="json")}
    with pytest.raises(UserError, match="index 4 is out of bounds"):
        check(data, config)
