"""Conformance (reference tinker-protocol.md §12, items 1-7) with the real tinker 0.38 SDK.

One gateway subprocess per runtime for the module, every case run against each: the local runtime
(TransformersBackend + a CPU engine subprocess) and the production Ray runtime (trainer and engine cells
brought up by the driver's bring-up on a local Ray), tiny model, configured with fwdbwd_max_chunk_len=2
and zstd bodies so chunking and decompression are always on.
Trainer maths is compared against a TransformersBackend in this process on the same weights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_gateway, start_ray_gateway
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY_A = "tml-conformance-alpha-0001"
KEY_B = "tml-conformance-bravo-0002"
ADAM = types.AdamParams(learning_rate=5e-3)
REF_ADAM = AdamParams(learning_rate=5e-3)
TEXTS = ["the cat sat on the mat", "one two three four", "hello world", "a b c d e f g", "tiny models learn"]


@pytest.fixture(scope="module", params=["local", "ray"])
def gateway(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """One gateway per runtime for the whole module (pytest groups the tests by it): the local runtime,
    and the production Ray runtime brought up by the driver's own bring-up (its rules - LoRA rank cap,
    adapter residency, the engine cell behind SGLang's API - under the same conformance cases)."""
    workdir = tmp_path_factory.mktemp(f"gateway-sdk-{request.param}")
    keys = {KEY_A: "alpha", KEY_B: "bravo"}
    extra = ("--fwdbwd-max-chunk-len", "2", "--long-poll-s", "3")
    if request.param == "ray":
        proc = start_ray_gateway(tiny_model_dir, workdir, keys, *extra)
    else:
        proc = start_gateway(tiny_model_dir, workdir, keys, "--proto-compress", *extra)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def service(gateway: GatewayProcess) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=gateway.url, api_key=KEY_A)


@pytest.fixture(scope="module")
def reference(gateway: GatewayProcess, tiny_model_dir: Path) -> TransformersBackend:
    """The trainer maths in this process, fresh for each gateway (its adapters mirror the gateway's)."""
    torch.set_num_threads(1)
    return TransformersBackend(str(tiny_model_dir), train_mode="lora")


@pytest.fixture(scope="module")
def token_rows(tiny_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return [tok.encode(t) for t in TEXTS]


def _sdk_datum(tokens: list[int], **extra: list[float]) -> types.Datum:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1), **extra}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _ref_datum(tokens: list[int], **extra: list[float]) -> Datum:
    inputs = {
        "target_tokens": np.asarray(tokens[1:], np.int64),
        "weights": np.ones(len(tokens) - 1, np.float32),
        **{k: np.asarray(v, np.float32) for k, v in extra.items()},
    }
    return Datum(model_input=np.asarray(tokens[:-1], np.int64), loss_fn_inputs=inputs)


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _new_pair(service: tinker.ServiceClient, reference: TransformersBackend, key: str):
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    reference.create_adapter(key, LoraSpec(rank=4, seed=0))
    return tc


# ---- 1. handshake ------------------------------------------------------------------------------


def test_handshake_capabilities_and_health(gateway: GatewayProcess, service: tinker.ServiceClient) -> None:
    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY_A)
    models = rest.get_server_capabilities().result().supported_models
    variant = f"{BASE_MODEL}:peft:{models[0].max_context_length}"  # the full-context variant's id
    assert [(m.model_name, m.trainable, m.sampleable) for m in models] == [
        (BASE_MODEL, True, True),
        (variant, True, True),
    ]
    assert httpx.get(f"{gateway.url}/api/v1/healthz").json() == {"status": "ok"}
    paths = [r["path"] for r in gateway.requests()]
    assert "/api/v1/client/config" in paths and "/api/v1/get_server_capabilities" in paths


# ---- 3 + 4. training maths, chunking, pipelining ----------------------------------------------


def test_cross_entropy_training_matches_torch_reference(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    tc = _new_pair(service, reference, "ce")
    sdk_data = [_sdk_datum(t) for t in token_rows]  # 5 datums, 2 per chunk -> 3 chunks
    ref_data = [_ref_datum(t) for t in token_rows]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(sdk_data, "cross_entropy")
        step = tc.optim_step(ADAM)  # pipelined: submitted before the fwd/bwd result is read
        out = fb.result()
        step.result()
        ref = reference.forward_backward("ce", ref_data, "cross_entropy", {})
        reference.optim_step("ce", REF_ADAM)
        got = _logprobs(out)
        assert [len(g) for g in got] == [len(t) - 1 for t in token_rows]  # datum order kept across chunks
        for g, r in zip(got, ref.logprobs, strict=True):
            np.testing.assert_allclose(g, r, atol=1e-4)
        assert out.metrics["loss:sum"] == pytest.approx(-sum(float(g.sum()) for g in got), abs=1e-3)
        assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], abs=1e-3)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", None),
        ("dro", {"beta": 0.3}),
        ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03}),
        ("stable_reinforce", {"kl_coeff": 0.5}),
    ],
)
def test_rl_losses_match_reference_and_forward_does_not_accumulate(
    service: tinker.ServiceClient,
    reference: TransformersBackend,
    token_rows: list[list[int]],
    loss_fn: str,
    config: dict | None,
) -> None:
    tc = _new_pair(service, reference, f"rl-{loss_fn}")
    rows = token_rows[:3]
    ce = [_sdk_datum(t) for t in rows]
    before = _logprobs(tc.forward(ce, "cross_entropy").result())
    again = _logprobs(tc.forward(ce, "cross_entropy").result())
    for a, b in zip(before, again, strict=True):
        np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(0)
    extras = [
        {"logprobs": (lp - 0.05).tolist(), "advantages": rng.normal(size=len(lp)).round(3).tolist()}
        for lp in before
    ]
    sdk = [_sdk_datum(t, **e) for t, e in zip(rows, extras, strict=True)]
    ref = [_ref_datum(t, **e) for t, e in zip(rows, extras, strict=True)]
    for _ in range(2):
        out = tc.forward_backward(sdk, loss_fn, loss_fn_config=config).result()
        tc.optim_step(ADAM).result()
        expected = reference.forward_backward(f"rl-{loss_fn}", ref, loss_fn, config or {})
        reference.optim_step(f"rl-{loss_fn}", REF_ADAM)
        for g, r in zip(_logprobs(out), expected.logprobs, strict=True):
            np.testing.assert_allclose(g, r, atol=1e-4)
        assert out.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], abs=1e-4)


def test_soft_targets_cross_entropy_matches_reference(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    """(N, K) target_tokens and weights, as a top-K distillation recipe sends them: 2-D torch tensors,
    which the SDK sends as sparse CSR (weights 0 are dropped on the wire)."""
    tc = _new_pair(service, reference, "soft")
    rng = np.random.default_rng(1)
    rows = token_rows[:3]
    targets = [rng.integers(0, 100, (len(t) - 1, 3)).astype(np.int64) for t in rows]
    weights = [
        np.where(rng.random((len(t) - 1, 3)) < 0.3, 0.0, rng.uniform(-0.5, 1.0, (len(t) - 1, 3)))
        for t in rows
    ]
    sdk = [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={
                "target_tokens": torch.tensor(tt),
                "weights": torch.tensor(w, dtype=torch.float32),
            },
        )
        for t, tt, w in zip(rows, targets, weights, strict=True)
    ]
    ref = [
        Datum(np.asarray(t[:-1], np.int64), {"target_tokens": tt, "weights": w.astype(np.float32)})
        for t, tt, w in zip(rows, targets, weights, strict=True)
    ]
    for _ in range(2):
        out = tc.forward_backward(sdk, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        expected = reference.forward_backward("soft", ref, "cross_entropy", {})
        reference.optim_step("soft", REF_ADAM)
        for g, r in zip(_logprobs(out), expected.logprobs, strict=True):
            assert g.shape == r.shape == (r.shape[0], 3)
            np.testing.assert_allclose(g, r, atol=1e-4)
        assert out.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], abs=1e-4)


def test_forward_backward_custom_signed_fractional_weights_reach_the_gradient(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    """The SDK's client-side custom loss sends cross_entropy with weights = -dC/dlogp. For
    C = sum(c * logp + logp^2 / 40), dC/dlogp = c + logp / 20: negative and fractional here."""
    tc = _new_pair(service, reference, "custom")
    rows = token_rows[:3]
    sdk = [_sdk_datum(t) for t in rows]
    coeffs = [np.linspace(-1.5, 0.75, len(t) - 1).astype(np.float32) for t in rows]

    def custom(data, logprobs):
        loss = sum(
            (torch.from_numpy(c) * lp).sum() + 0.025 * (lp**2).sum()
            for c, lp in zip(coeffs, logprobs, strict=True)
        )
        return loss, {"custom:sum": float(loss.detach())}

    tc.forward_backward_custom(sdk, custom).result()
    tc.optim_step(ADAM).result()
    plain = [_ref_datum(t) for t in rows]
    lps = reference.forward_backward("custom", plain, "cross_entropy", {}, forward_only=True).logprobs
    weights = [-(c + 0.05 * lp) for c, lp in zip(coeffs, lps, strict=True)]
    flat = np.concatenate(weights)
    assert (flat < 0).any() and (flat > 0).any() and not np.allclose(flat, np.round(flat))
    signed = [_ref_datum(t, weights=w.tolist()) for t, w in zip(rows, weights, strict=True)]
    reference.forward_backward("custom", signed, "cross_entropy", {})
    reference.optim_step("custom", REF_ADAM)
    after = _logprobs(tc.forward(sdk, "cross_entropy").result())
    expected = reference.forward_backward("custom", plain, "cross_entropy", {}, forward_only=True).logprobs
    for g, r in zip(after, expected, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4)


def test_a_server_side_custom_loss_trains_as_its_gradient_says_in_one_request_per_chunk(
    gateway: GatewayProcess, service: tinker.ServiceClient, reference: TransformersBackend, token_rows
) -> None:
    """create_custom_loss on both runtimes (on Ray the program crosses to the trainer cell inside the
    command): C = sum(c * logp + logp^2 / 40) per datum, so dC/dlogp = c + logp / 20, as the test above;
    the step equals cross_entropy with weights -dC/dlogp on the reference, and each chunk of the batch
    is one forward_backward (no forward first)."""

    def quadratic(logprobs, coeff):
        loss = (coeff * logprobs).sum() + 0.025 * (logprobs**2).sum()
        return loss, {"custom/quadratic:sum": loss.detach(), "custom/first:mean": logprobs[0].detach()}

    handle = service.create_custom_loss(quadratic, {"logprobs": 1, "coeff": 1}).result()
    assert handle.loss_id is not None
    tc = _new_pair(service, reference, "custom-server")
    rows = token_rows[:3]
    coeffs = [np.linspace(-1.5, 0.75, len(t) - 1).astype(np.float32) for t in rows]
    sdk = [_sdk_datum(t, coeff=c) for t, c in zip(rows, coeffs, strict=True)]  # an array: any key
    before = sum(r["path"] == "/api/v1/forward_backward" for r in gateway.requests())
    out = tc.forward_backward_custom(sdk, handle).result()
    sent = sum(r["path"] == "/api/v1/forward_backward" for r in gateway.requests()) - before
    assert sent == 2  # 3 datums in chunks of 2 (--fwdbwd-max-chunk-len): one request each
    tc.optim_step(ADAM).result()

    plain = [_ref_datum(t) for t in rows]
    lps = reference.forward_backward("custom-server", plain, "cross_entropy", {}, forward_only=True).logprobs
    want = sum(float((c * lp).sum() + 0.025 * (lp**2).sum()) for c, lp in zip(coeffs, lps, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    assert out.metrics["custom/quadratic:sum"] == pytest.approx(want, rel=1e-4)
    assert out.metrics["custom/first:mean"] == pytest.approx(np.mean([lp[0] for lp in lps]), rel=1e-4)
    weights = [-(c + 0.05 * lp) for c, lp in zip(coeffs, lps, strict=True)]
    signed = [_ref_datum(t, weights=w.tolist()) for t, w in zip(rows, weights, strict=True)]
    reference.forward_backward("custom-server", signed, "cross_entropy", {})
    reference.optim_step("custom-server", REF_ADAM)
    after = _logprobs(tc.forward(sdk, "cross_entropy").result())
    expected = reference.forward_backward(
        "custom-server", plain, "cross_entropy", {}, forward_only=True
    ).logprobs
    for g, r in zip(after, expected, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4)


def test_stable_reinforce_takes_the_sampler_logprobs_from_the_provenance_it_names(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    """The rl_loop path: sample with record_stability_info, attach provenance, train stable_reinforce.
    The client's `logprobs` copy is deliberately wrong on the sampled tokens: the gateway must use what
    the sampler recorded there (and the client's values on prompt tokens)."""
    tc = _new_pair(service, reference, "stable")
    sampler = tc.save_weights_and_get_sampling_client(name="stable-0", record_stability_info=True).result()
    prompt = token_rows[1][:5]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    ).result()
    sdk, ref, wrong = [], [], []
    for seq in result.sequences:
        sampled, recorded = list(seq.tokens), np.asarray(seq.logprobs, np.float32)
        tokens = prompt + sampled
        n = len(tokens) - 1
        client = np.full(n, -3.0, np.float32)
        advantages = np.r_[np.zeros(len(prompt) - 1), np.full(len(sampled), 0.7)].astype(np.float32)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": client, "advantages": advantages},
        ).with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled) - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled)),
            ],
        )
        sdk.append(datum)
        true_q = np.r_[client[: len(prompt) - 1], recorded]
        ref.append(_ref_datum(tokens, logprobs=true_q.tolist(), advantages=advantages.tolist()))
        wrong.append(_ref_datum(tokens, logprobs=client.tolist(), advantages=advantages.tolist()))
    config = {"kl_coeff": 0.5}
    out = tc.forward_backward(sdk, "stable_reinforce", loss_fn_config=config).result()
    expected = reference.forward_backward("stable", ref, "stable_reinforce", config, forward_only=True)
    with_client_copy = reference.forward_backward(
        "stable", wrong, "stable_reinforce", config, forward_only=True
    )
    assert out.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], abs=1e-3)
    assert abs(with_client_copy.metrics["loss:sum"] - expected.metrics["loss:sum"]) > 0.1


# ---- 5. sampling -----------------------------------------------------------------------------


def test_sampling_counts_seeds_stops_and_trainer_consistency(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    tc = _new_pair(service, reference, "sampling")
    data = [_sdk_datum(t) for t in token_rows[:2]]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(token_rows[0][:4])

    never_stop = types.SamplingParams(max_tokens=6, seed=7, stop=[])
    first = sampler.sample(prompt, num_samples=3, sampling_params=never_stop).result()
    second = sampler.sample(prompt, num_samples=3, sampling_params=never_stop).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in second.sequences]
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in first.sequences)
    assert all(len(s.logprobs) == 6 and all(lp <= 0 for lp in s.logprobs) for s in first.sequences)
    ids = [s.sequence_id for s in first.sequences]
    assert len(set(ids)) == 3 and all(ids)

    tokens = first.sequences[0].tokens
    stop_at = types.SamplingParams(max_tokens=6, seed=7, stop=[tokens[2]])
    stopped = sampler.sample(prompt, num_samples=1, sampling_params=stop_at).result().sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens[-1] == tokens[2]
    assert len(stopped.tokens) <= 3 and stopped.tokens == tokens[: len(stopped.tokens)]

    # The sampler's logprobs of a sequence equal the trainer's forward logprobs (post-optim_step weights).
    seq = token_rows[1]
    sampled_lp = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()
    assert sampled_lp[0] is None
    trainer_lp = _logprobs(tc.forward([_sdk_datum(seq)], "cross_entropy").result())[0]
    np.testing.assert_allclose(np.asarray(sampled_lp[1:], np.float32), trainer_lp, atol=1e-4)
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(seq)).result()
    assert np.abs(np.asarray(base_lp[1:]) - trainer_lp).max() > 1e-3  # the snapshot is not the base


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the model's next-token logprobs after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _top(row: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    values, ids = torch.topk(row, k)
    return ids.tolist(), values.tolist()


def test_topk_target_last_n_and_alt_tokens_match_the_model(
    service: tinker.ServiceClient, tiny_model_dir: Path, token_rows: list[list[int]]
) -> None:
    """Every SampleRequest logprob option through the SDK, against the base model computed here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    seq = token_rows[0]
    n = len(seq)
    reference = _model_logprobs(model, seq)
    sampler = service.create_sampling_client(base_model=BASE_MODEL).result()
    targets = torch.full((n - 1, 6), -1, dtype=torch.int64)
    targets[n - 2, :2] = torch.tensor([seq[-1], 7])  # sparse: the SDK sends CSR, the answer keeps it
    targets[1, 3] = 11
    params = types.SamplingParams(max_tokens=3, seed=5, stop=[])
    out = sampler.sample(
        types.ModelInput.from_ints(seq),
        num_samples=2,
        sampling_params=params,
        include_prompt_logprobs=True,
        prompt_logprobs_last_n=2,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(targets, pad_value=-1),
        prompt_alt_tokens_k=4,
    ).result()

    assert out.prompt_logprobs[: n - 2] == [None] * (n - 2)
    expected = [float(reference[p - 1, seq[p]]) for p in (n - 2, n - 1)]
    np.testing.assert_allclose(out.prompt_logprobs[n - 2 :], expected, atol=1e-4)
    assert out.topk_prompt_logprobs[: n - 2] == [None] * (n - 2)
    for p in (n - 2, n - 1):
        ids, values = _top(reference[p - 1], 3)
        assert [t for t, _ in out.topk_prompt_logprobs[p]] == ids
        np.testing.assert_allclose([lp for _, lp in out.topk_prompt_logprobs[p]], values, atol=1e-4)

    target = out.target_prompt_logprobs
    assert target.sparse_crow_indices is not None  # the request's layout
    got = target.to_numpy(pad_value=0)
    want = np.zeros((n - 1, 6), np.float32)
    for r, c in zip(*np.nonzero(targets.numpy() >= 0), strict=True):
        want[r, c] = float(reference[r, targets[r, c]])  # row r scores prompt position r + 1
    np.testing.assert_allclose(got, want, atol=1e-4)

    for s in out.sequences:
        full = _model_logprobs(model, seq + s.tokens)
        assert len(s.topk_logprobs) == len(s.tokens) == 3
        for i, row in enumerate(s.topk_logprobs):
            ids, values = _top(full[n - 1 + i], 2)
            assert [t for t, _ in row] == ids
            np.testing.assert_allclose([lp for _, lp in row], values, atol=1e-4)

    alt = out.prompt_alt_tokens
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (n - 1, 4)
    for r, c in np.ndindex(tokens.shape):
        assert logprobs[r, c] == pytest.approx(float(reference[r, tokens[r, c]]), abs=1e-4)

    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n"):
        sampler.sample(
            types.ModelInput.from_ints(seq[:3]),
            num_samples=1,
            sampling_params=params,
            include_prompt_logprobs=True,
            prompt_logprobs_last_n=5,
        ).result()


def test_an_inflight_sampler_follows_the_trainers_later_inflight_saves(
    service: tinker.ServiceClient, reference: TransformersBackend, token_rows: list[list[int]]
) -> None:
    tc = _new_pair(service, reference, "inflight")
    prompt = types.ModelInput.from_ints(token_rows[1])
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = np.asarray(inflight.compute_logprobs(prompt).result()[1:], np.float32)
    tc.forward_backward([_sdk_datum(t) for t in token_rows[:2]], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    tc.save_weights_and_get_sampling_client(kind="inflight").result()  # publishes the new weights

    trainer = _logprobs(tc.forward([_sdk_datum(token_rows[1])], "cross_entropy").result())[0]
    after = np.asarray(inflight.compute_logprobs(prompt).result()[1:], np.float32)
    np.testing.assert_allclose(after, trainer, atol=1e-4)  # the earlier client samples the new weights
    assert np.abs(after - before).max() > 1e-3
    kept = np.asarray(snapshot.compute_logprobs(prompt).result()[1:], np.float32)
    np.testing.assert_allclose(kept, before, atol=1e-5)  # a snapshot client never moves


# ---- 6. checkpoints ----------------------------------------------------------------------------


def test_checkpoints_resume_sampler_paths_and_rest(
    gateway: GatewayProcess, service: tinker.ServiceClient, reference: TransformersBackend, token_rows
) -> None:
    tc = _new_pair(service, reference, "ckpt")
    data = [_sdk_datum(t) for t in token_rows[:2]]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    state_path = tc.save_state("step-1").result().path
    assert state_path == f"tinker://{tc.model_id}/weights/step-1"

    plain = service.create_training_client_from_state(state_path).result()
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    want = _logprobs(tc.forward(data, "cross_entropy").result())
    for client in (plain, resumed):
        for g, w in zip(_logprobs(client.forward(data, "cross_entropy").result()), want, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5)
    # With the optimizer state restored, one more step lands exactly where the original does.
    for client in (tc, resumed):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
    for g, w in zip(
        _logprobs(resumed.forward(data, "cross_entropy").result()),
        _logprobs(tc.forward(data, "cross_entropy").result()),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, atol=1e-5)

    sampler_path = tc.save_weights_for_sampler("snap-a").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/snap-a"
    by_path = service.create_sampling_client(model_path=sampler_path).result()
    lp = by_path.compute_logprobs(types.ModelInput.from_ints(token_rows[0])).result()
    np.testing.assert_allclose(
        np.asarray(lp[1:], np.float32),
        _logprobs(tc.forward(data[:1], "cross_entropy").result())[0],
        atol=1e-4,
    )

    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY_A)
    run = rest.get_training_run_by_tinker_path(state_path).result()
    assert run.training_run_id == tc.model_id and run.is_lora and run.lora_rank == 4
    listed = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {"weights/step-1", "sampler_weights/snap-a"} <= listed
    rest.delete_checkpoint(tc.model_id, "weights/step-1").result()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert "weights/step-1" not in listed and "sampler_weights/snap-a" in listed

    other = tinker.RestClient(base_url=gateway.url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(tc.model_id).result()


# ---- 7. errors ---------------------------------------------------------------------------------


def test_errors_are_typed_and_fast(
    gateway: GatewayProcess, service: tinker.ServiceClient, token_rows
) -> None:
    before = len(gateway.requests())
    with pytest.raises(tinker.BadRequestError):
        service.create_lora_training_client(base_model="org/not-a-model", rank=4).result()
    attempts = [r for r in gateway.requests()[before:] if r["path"] == "/api/v1/create_model"]
    assert [r["status"] for r in attempts] == [400]  # answered once, with a body, not retried

    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    with pytest.raises(tinker.RequestFailedError) as bad_loss:
        tc.forward_backward([_sdk_datum(token_rows[0])], "dpo").result()
    assert bad_loss.value.category == RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError) as missing:
        tc.forward_backward([_sdk_datum(token_rows[0])], "ppo").result()  # no logprobs/advantages
    assert missing.value.category == RequestErrorCategory.User
    assert "Traceback" not in missing.value.message

    headers = {"X-API-Key": KEY_A}
    r = httpx.post(f"{gateway.url}/api/v1/retrieve_future", json={"request_id": "req-nope"}, headers=headers)
    assert r.status_code == 404 and r.json()["detail"]

    # Duplicate submits (same model, same seq_id) get the same future.
    body = {
        "model_id": tc.model_id,
        "seq_id": 1000,
        "adam_params": {"learning_rate": 0.0},
        "type": "optim_step",
    }
    first = httpx.post(f"{gateway.url}/api/v1/optim_step", json=body, headers=headers).json()
    retry = httpx.post(f"{gateway.url}/api/v1/optim_step", json=body, headers=headers).json()
    assert first["request_id"] == retry["request_id"]
    # seq_id 1000 leaves a gap, so the long poll ends with try_again (bounded well below the SDK's 45 s).
    started = time.monotonic()
    poll = httpx.post(
        f"{gateway.url}/api/v1/retrieve_future",
        json={"request_id": first["request_id"]},
        headers=headers,
        timeout=60,
    )
    assert poll.json()["type"] == "try_again" and time.monotonic() - started < 45


def test_wire_refusals_rank_zero_and_a_first_checkpoint_with_optimizer(
    gateway: GatewayProcess, service: tinker.ServiceClient, token_rows: list[list[int]]
) -> None:
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    data = [_sdk_datum(t) for t in token_rows[:2]]
    # a state saved before any optim_step loads "with optimizer" (an empty one), as a recipe resuming
    # its own first checkpoint does; both then take the same step
    first = tc.save_state("before-any-step").result().path
    resumed = service.create_training_client_from_state_with_optimizer(first).result()
    # a request refused with a 4xx (here a non-Adam optimizer) must not stall the next seq_id: without
    # accounting for it, the next request waits 120 s for the missing seq_id and then fails
    with pytest.raises(tinker.BadRequestError, match="only Adam"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    for client in (tc, resumed):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
    for g, w in zip(
        _logprobs(resumed.forward(data, "cross_entropy").result()),
        _logprobs(tc.forward(data, "cross_entropy").result()),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, atol=1e-5)
    # the Ray runtime's engines are started for ranks up to the preset's model.lora_rank (8 in tiny-cpu):
    # a larger rank is refused before queueing; the local runtime has no engine rank cap
    if gateway.runtime == "ray":
        with pytest.raises(tinker.BadRequestError, match="LoRA rank 16 is above this job's maximum 8"):
            service.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
    # rank 0 asks for full fine-tuning, which this (LoRA) job refuses with a reason
    with pytest.raises(
        tinker.BadRequestError, match="rank=0 \\(full fine-tuning\\) needs a job whose train_mode is full"
    ):
        service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()


# ---- publishing, external weights, listings -------------------------------------------------------


def _hf_logprobs(model_dir: Path, rows: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for tokens in rows:
            logits = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0].float(), dim=-1)
            out.append(logits.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy())
    return out


def test_external_weights_download_with_the_sdk_helper_and_reproduce_the_trainer(
    gateway: GatewayProcess, service: tinker.ServiceClient, token_rows: list[list[int]], tmp_path: Path
) -> None:
    from tinker.cli.commands.checkpoint import _download_external_weights

    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    data = [_sdk_datum(t) for t in token_rows[:2]]
    for _ in range(2):  # LoRA's B starts at zero: only a trained adapter changes the model
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    older = tc.save_state("before-export").result().path
    export = tc.save_weights_external("hf").result().path
    assert export == f"tinker://{tc.model_id}/external_weights/hf"
    rest = tinker.RestClient(base_url=gateway.url, api_key=KEY_A)
    assert "model.safetensors" in rest.get_external_weights_urls(export).result().urls
    with pytest.raises(tinker.NotFoundError):  # another tenant's export, unpublished
        tinker.RestClient(base_url=gateway.url, api_key=KEY_B).get_external_weights_urls(export).result()

    size = _download_external_weights(rest, export, tmp_path, show_progress=False, format="json")
    assert (
        size > 0 and (tmp_path / "model.safetensors").is_file() and not (tmp_path / "metadata.json").exists()
    )
    trainer = _logprobs(tc.forward(data, "cross_entropy").result())
    for got, want in zip(_hf_logprobs(tmp_path, token_rows[:2]), trainer, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)

    newest = rest.list_user_checkpoints(limit=2).result()  # newest first, across runs
    assert [(c.tinker_path, c.checkpoint_type) for c in newest.checkpoints] == [
        (export, "external"),
        (older, "training"),
    ]
    assert newest.cursor is not None and newest.cursor.total_count >= 2
    assert tc.get_info().model_data.arch == "qwen3"  # from the model's config, not a constant
    assert rest.get_training_run_by_tinker_path(export).result().training_run_id == tc.model_id
    session_id = service.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    assert tc.model_id in rest.get_session(session_id).result().training_run_ids


def test_a_published_snapshot_is_sampled_by_another_tenant_until_unpublished(
    gateway: GatewayProcess, service: tinker.ServiceClient, token_rows: list[list[int]]
) -> None:
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    snapshot = tc.save_weights_for_sampler("shared").result().path
    owner = tinker.RestClient(base_url=gateway.url, api_key=KEY_A)
    other = tinker.ServiceClient(base_url=gateway.url, api_key=KEY_B)
    other_rest = tinker.RestClient(base_url=gateway.url, api_key=KEY_B)
    prompt = types.ModelInput.from_ints(token_rows[0])

    with pytest.raises(tinker.NotFoundError):
        other_rest.get_weights_info_by_tinker_path(snapshot).result()
    owner.publish_checkpoint_from_tinker_path(snapshot).result()
    owner.publish_checkpoint_from_tinker_path(snapshot).result()  # already published: no error
    with pytest.raises(tinker.NotFoundError):  # publishing shares reading, not the owner's rights
        other_rest.unpublish_checkpoint_from_tinker_path(snapshot).result()
    assert other_rest.get_weights_info_by_tinker_path(snapshot).result().lora_rank == 4
    theirs = other.create_sampling_client(model_path=snapshot).result().compute_logprobs(prompt).result()
    mine = service.create_sampling_client(model_path=snapshot).result().compute_logprobs(prompt).result()
    np.testing.assert_allclose(np.asarray(theirs[1:]), np.asarray(mine[1:]), atol=1e-6)
    listed = owner.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.public for c in listed if c.tinker_path == snapshot] == [True]

    owner.unpublish_checkpoint_from_tinker_path(snapshot).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=snapshot).result()


# ---- 2. wire goldens + 1. heartbeat / finish ---------------------------------------------------


def test_wire_goldens_from_the_request_log(gateway: GatewayProcess) -> None:
    log = gateway.requests()
    fwd = [r for r in log if r["path"] == "/api/v1/forward_backward"]
    assert fwd and all(r["headers"]["content-type"] == "application/x-protobuf" for r in fwd)
    assert all(r["headers"].get("content-encoding") == "zstd" for r in fwd)
    assert all(r["proto"]["num_datums"] <= 2 for r in fwd)  # fwdbwd_max_chunk_len from client/config
    ppo = [r["proto"] for r in fwd if r["proto"]["loss_fn"] == "ppo" and r["proto"]["loss_config"]]
    assert ppo and ppo[0]["loss_config"] == {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert any(r["proto"]["forward_only"] for r in fwd)
    create = next(r["json"] for r in log if r["path"] == "/api/v1/create_model" and r["status"] == 200)
    assert create["lora_config"]["rank"] == 4 and create["type"] == "create_model"
    # Per model, seq_ids of the submitted operations are unique (chunks, optim steps, saves).
    seqs: dict[str, list[int]] = {}
    for r in log:
        if r["path"] == "/api/v1/forward_backward":
            seqs.setdefault(r["proto"]["model_id"], []).append(r["proto"]["seq_id"])
        elif r["path"] in (
            "/api/v1/optim_step",
            "/api/v1/save_weights",
            "/api/v1/save_weights_for_sampler",
            "/api/v1/save_weights_external",
        ):
            seqs.setdefault(r["json"]["model_id"], []).append(r["json"]["seq_id"])
    for model_seqs in seqs.values():
        if 1000 not in model_seqs:
            assert sorted(model_seqs) == list(range(1, len(model_seqs) + 1))
    sample = next(r for r in log if r["path"] == "/api/v1/asample")
    assert {"sampling_session_id", "seq_id", "num_samples", "prompt"} <= set(sample["json"])
    polls = [
        r for r in log if r["path"] == "/api/v1/retrieve_future" and "x-tinker-request-type" in r["headers"]
    ]
    assert {"ForwardBackward", "OptimStep", "Sample"} <= {
        r["headers"]["x-tinker-request-type"] for r in polls
    }


def test_heartbeats_finish_and_410(gateway: GatewayProcess) -> None:
    with tinker.ServiceClient(base_url=gateway.url, api_key=KEY_A) as sc:
        sc.create_sampling_client(base_model=BASE_MODEL).result()  # sessions are created lazily
        session_id = sc.holder.get_session_id()
        deadline = time.monotonic() + 20
        beats: list[dict] = []
        # this session's beats only: an earlier test's SDK client whose gateway is gone keeps beating at
        # its old address, which this gateway may now have (a CI run saw such a beat refused with 401)
        while time.monotonic() < deadline and not beats:
            beats = [
                r
                for r in gateway.requests()
                if r["path"] == "/api/v1/session_heartbeat" and r["json"]["session_id"] == session_id
            ]
            time.sleep(0.5)
        assert beats and beats[0]["status"] == 200
    finishes = [r for r in gateway.requests() if r["path"] == f"/api/v1/sessions/{session_id}/finish"]
    assert finishes and finishes[-1]["status"] == 200
    r = httpx.post(
        f"{gateway.url}/api/v1/session_heartbeat",
        json={"session_id": session_id, "type": "session_heartbeat"},
        headers={"X-API-Key": KEY_A},
    )
    assert r.status_code == 410 and r.json()["detail"]


# ---- 9. tokenizers through a fake Hugging Face cache (offline) ---------------------------------

_TOKENIZER_CHECK = """
import sys, tinker
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
sampler = sc.create_sampling_client(base_model=sys.argv[3]).result()
training = sc.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
a = sampler.get_tokenizer().encode("hello world")
b = training.get_tokenizer().encode("hello world")
assert a == b and a, (a, b)
print("ok", a)
"""


def test_sdk_tokenizers_load_offline_from_a_fake_hf_cache(
    gateway: GatewayProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    revision = "0" * 40
    repo = tmp_path / "hf" / "hub" / f"models--{BASE_MODEL.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, snapshot / name)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _TOKENIZER_CHECK, gateway.url, KEY_A, BASE_MODEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
