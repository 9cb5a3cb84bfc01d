"""The gateway's sampling limits, retry dedup and failure reporting, through its HTTP surface.

Each test here kills a mutant that survived the fast suite (docs/testing.md): removing asample dedup,
dropping the max_context check, removing the max_concurrent_samples bound,
ignoring queue_timeout, reporting trainer user errors as server errors, keeping a model record after a
failed create. Requests are built from the tinker SDK's own types where the SDK defines them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from ray.exceptions import RayTaskError
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response
from tinker.types import SampleRequest
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from miles.errors import UserError
from miles.seam import requests as seam_requests
from miles.train.errors import RemoteCommandError
from miles.types import ForwardBackwardOutput, SamplingParams

KEY = "tml-limits-key-0001"
HEADERS = {"X-API-Key": KEY}
OTHER_KEY = "tml-limits-key-0002"  # a second tenant
BEARER = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT = 512  # the double's model card
OTHER_BASE = "Qwen/Qwen3-4B"  # a second base model (TwoLaneRuntime)


class GatedRuntime(DoubleRuntime):
    """The double, with gates that hold samples / training steps until a test opens them, a count of
    samples in flight, and a failure `create_model` / `forward_backward` can be told to raise."""

    def __init__(self, tokenizer_path: str) -> None:
        super().__init__(tokenizer_path=tokenizer_path)
        self.sample_gate = asyncio.Event()
        self.sample_gate.set()
        self.train_gate = asyncio.Event()
        self.train_gate.set()
        self.samples_in_flight = 0
        self.most_samples_in_flight = 0
        self.sampled_with: list[SamplingParams] = []
        self.create_failure: BaseException | None = None
        self.train_failure: BaseException | None = None

    async def sample(self, target: Any, prompt: list[int], params: SamplingParams, *args: Any, **kwargs: Any):
        self.sampled_with.append(params)
        self.samples_in_flight += 1
        self.most_samples_in_flight = max(self.most_samples_in_flight, self.samples_in_flight)
        try:
            await self.sample_gate.wait()
            return await super().sample(target, prompt, params, *args, **kwargs)
        finally:
            self.samples_in_flight -= 1

    async def create_model(self, model_id: str, base_model: str, lora: Any) -> None:
        if self.create_failure is not None:
            self.calls.append(("create_model", model_id))
            raise self.create_failure
        await super().create_model(model_id, base_model, lora)

    async def forward_backward(self, request: seam_requests.ForwardBackwardRequest) -> ForwardBackwardOutput:
        await self.train_gate.wait()
        if self.train_failure is not None:
            self.calls.append(("forward_backward", request.model_id))
            raise self.train_failure
        return await super().forward_backward(request)

    def count(self, call: str) -> int:
        return sum(1 for name, _ in self.calls if name == call)


@pytest.fixture
def gateway(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., contextlib.AbstractAsyncContextManager]:
    """`async with gateway(**settings) as (client, runtime)`: the app over a fresh GatedRuntime."""

    @contextlib.asynccontextmanager
    async def running(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, GatedRuntime]]:
        runtime = GatedRuntime(str(tiny_model_dir))  # its tokenizer serves the OpenAI routes
        app = double_app(tmp_path, runtime, {KEY: "alpha", OTHER_KEY: "bravo"}, long_poll_s=0.2, **settings)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as client:
                yield client, runtime
        finally:
            runtime.sample_gate.set()
            runtime.train_gate.set()
            await app.state.gateway.ops.close()

    return running


async def _result(client: httpx.AsyncClient, request_id: str) -> httpx.Response:
    """The resolved future (polling through `try_again`)."""
    for _ in range(100):
        r = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS)
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError(f"future {request_id} never resolved")


async def _failure(client: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    body = (await _result(client, request_id)).json()
    assert body.get("error"), f"expected a failed future, got {body}"
    return body


async def _session(client: httpx.AsyncClient) -> str:
    r = await client.post("/api/v1/create_session", json={"tags": []}, headers=HEADERS)
    return r.json()["session_id"]


async def _sampler(client: httpx.AsyncClient) -> str:
    """A sampling session on the base model."""
    body = {"session_id": await _session(client), "sampling_session_seq_id": 0, "base_model": BASE}
    r = await client.post("/api/v1/create_sampling_session", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _sample_body(prompt: list[int], **fields: Any) -> dict[str, Any]:
    """An asample body as the SDK sends it (its SampleRequest model)."""
    fields.setdefault("base_model", None if "sampling_session_id" in fields else BASE)
    request = SampleRequest(
        prompt=tinker.ModelInput.from_ints(prompt),
        sampling_params=tinker.SamplingParams(max_tokens=2),
        **fields,
    )
    return request.model_dump(mode="json", exclude_none=True)


def _tensor_json(td: tinker.TensorData) -> dict[str, Any]:
    """A TensorData as the SDK puts it on the asample wire (its JSON shape)."""
    fields = ("data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices")
    out = {name: getattr(td, name) for name in fields if getattr(td, name) is not None}
    out["data"] = np.asarray(out["data"]).tolist()
    return out


async def _asample(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    return await client.post("/api/v1/asample", json=body, headers={**HEADERS, **headers})


async def _create_model(client: httpx.AsyncClient) -> tuple[str, str]:
    """(model_id, request_id of its create_model future)."""
    body = {
        "session_id": await _session(client),
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4},
    }
    r = await client.post("/api/v1/create_model", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["model_id"], r.json()["request_id"]


def _fwdbwd(model_id: str, seq_id: int) -> bytes:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": tinker.TensorData(data=[2, 3, 4], dtype="int64", shape=[3])},
    )
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


async def _submit_fwdbwd(client: httpx.AsyncClient, model_id: str, seq_id: int) -> str:
    r = await client.post("/api/v1/forward_backward", content=_fwdbwd(model_id, seq_id), headers=HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


# --- asample dedup ---------------------------------------------------------------------------------


async def test_a_retried_asample_gets_the_first_future_and_samples_once(gateway) -> None:
    async with gateway() as (client, runtime):
        sampler_id = await _sampler(client)
        body = _sample_body([5, 6, 7], sampling_session_id=sampler_id, seq_id=0)
        first = (await _asample(client, body)).json()["request_id"]
        retry = (await _asample(client, body)).json()["request_id"]
        assert retry == first
        assert (await _result(client, first)).status_code == 200
        late_retry = (await _asample(client, body)).json()["request_id"]
        assert late_retry == first, "a retry after the result still answers with the first future"
        assert runtime.count("sample") == 1

        following = (await _asample(client, {**body, "seq_id": 1})).json()["request_id"]
        assert following != first
        await _result(client, following)
        assert runtime.count("sample") == 2


async def test_an_idempotency_key_dedups_asample_on_a_base_model(gateway) -> None:
    async with gateway() as (client, runtime):
        body = _sample_body([5, 6, 7])
        first = (await _asample(client, body, **{"X-Idempotency-Key": "k-1"})).json()["request_id"]
        retry = (await _asample(client, body, **{"X-Idempotency-Key": "k-1"})).json()["request_id"]
        other = (await _asample(client, body, **{"X-Idempotency-Key": "k-2"})).json()["request_id"]
        assert retry == first and other != first
        for request_id in (first, other):
            await _result(client, request_id)
        assert runtime.count("sample") == 2


async def test_the_same_idempotency_key_from_two_tenants_is_two_requests(gateway) -> None:
    async with gateway() as (client, runtime):
        body = _sample_body([5, 6, 7])
        mine = (await _asample(client, body, **{"X-Idempotency-Key": "k-1"})).json()["request_id"]
        theirs = await _asample(client, body, **{"X-API-Key": OTHER_KEY, "X-Idempotency-Key": "k-1"})
        assert theirs.json()["request_id"] != mine
        assert (await _result(client, mine)).status_code == 200
        await _until(lambda: runtime.count("sample") == 2, "both tenants' samples ran")


async def test_a_retried_create_model_creates_once_and_keeps_the_metadata(gateway) -> None:
    async with gateway() as (client, runtime):
        sid = await _session(client)
        body = {
            "session_id": sid,
            "model_seq_id": 0,
            "base_model": BASE,
            "lora_config": {"rank": 4},
            "user_metadata": {"experiment": "e7"},
        }
        first = await client.post("/api/v1/create_model", json=body, headers=HEADERS)
        retry = await client.post("/api/v1/create_model", json=body, headers=HEADERS)
        assert retry.json()["request_id"] == first.json()["request_id"]
        assert (await _result(client, first.json()["request_id"])).status_code == 200
        assert runtime.count("create_model") == 1
        model_id = first.json()["model_id"]
        run = (await client.get(f"/api/v1/training_runs/{model_id}", headers=HEADERS)).json()
        assert run["user_metadata"] == {"experiment": "e7"}


# --- Tinker's extra logprob options: accepted, answered in the SDK's shapes, bad values refused ------------


async def test_logprob_options_reach_the_runtime_and_come_back_in_the_sdks_shapes(gateway) -> None:
    """Every option at once; the double answers deterministic values, decoded by the SDK's own reader."""
    target = np.array([[5, -1], [7, 9]], dtype=np.int64)  # rows for prompt positions 1 and 2
    body = _sample_body(
        [5, 6, 7],
        prompt_logprobs=True,
        prompt_logprobs_last_n=1,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=3,
        prompt_alt_tokens_k=2,
        target_prompt_logprobs=_tensor_json(tinker.TensorData.from_numpy(target)),
    )
    async with gateway() as (client, _runtime):
        r = await _asample(client, body)
        assert r.status_code == 200, r.text
        sdk = deserialize_sample_response((await _result(client, r.json()["request_id"])).content)
    assert sdk.prompt_logprobs == [None, None, -1.0]  # only the last token scored
    assert sdk.topk_prompt_logprobs == [None, None, [(3, -1.0), (4, -2.0)]]
    assert sdk.sequences[0].topk_logprobs == [[(t + 1, -1.0), (t + 2, -2.0), (t + 3, -3.0)] for t in range(2)]
    np.testing.assert_allclose(
        sdk.target_prompt_logprobs.to_numpy(), [[-0.05, 0.0], [-0.07, -0.09]], rtol=1e-6
    )
    assert sdk.prompt_alt_tokens.tokens.to_numpy().tolist() == [[0, 1], [2, 3]]
    assert sdk.prompt_alt_tokens.logprobs.to_numpy().tolist() == [[-2.0, -2.0], [-2.0, -2.0]]


async def test_a_sparse_target_is_answered_in_the_requests_sparse_layout(gateway) -> None:
    ids = torch.full((2, 8), -1, dtype=torch.int64)
    ids[1, 3] = 9  # one named cell: the SDK sends it as sparse CSR
    body = _sample_body(
        [5, 6, 7], target_prompt_logprobs=_tensor_json(tinker.TensorData.from_torch_sparse(ids, pad_value=-1))
    )
    assert body["target_prompt_logprobs"].get("sparse_crow_indices") is not None
    async with gateway() as (client, _runtime):
        r = await _asample(client, body)
        assert r.status_code == 200, r.text
        sdk = deserialize_sample_response((await _result(client, r.json()["request_id"])).content)
    answer = sdk.target_prompt_logprobs
    assert answer.sparse_crow_indices == [0, 0, 1] and answer.sparse_col_indices == [3]
    expected = np.zeros((2, 8))
    expected[1, 3] = -0.09
    np.testing.assert_allclose(answer.to_numpy(pad_value=0), expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs must be 0 or greater"),
        ({"topk_sample_logprobs": 1 << 20}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": -2}, "prompt_alt_tokens_k must be 0 or greater"),
        ({"prompt_logprobs_last_n": 1}, "set prompt_logprobs"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "between 1 and len(prompt) - 1 = 2"),
        ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [2]}}, "must be 2-D"),
        ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}, "needs 2"),
        ({"target_prompt_logprobs": {"data": [-1, -1], "dtype": "int64", "shape": [2, 1]}}, "names no token"),
        ({"target_prompt_logprobs": {"data": [1.0, 2.0], "dtype": "float32", "shape": [2, 1]}}, "int64"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
async def test_bad_logprob_options_are_refused_with_what_to_fix(gateway, option, says) -> None:
    async with gateway() as (client, runtime):
        r = await client.post("/api/v1/asample", json={**_sample_body([5, 6, 7]), **option}, headers=HEADERS)
        assert r.status_code == 400, r.text
        assert says in r.json()["detail"]
        assert runtime.count("sample") == 0


async def test_default_options_are_accepted(gateway) -> None:
    async with gateway() as (client, runtime):
        r = await _asample(client, _sample_body([5, 6, 7], topk_prompt_logprobs=0, topk_sample_logprobs=0))
        assert r.status_code == 200, r.text
        assert (await _result(client, r.json()["request_id"])).status_code == 200
        assert runtime.count("sample") == 1


# --- stop conditions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "strings", "token_ids"),
    [
        (None, None, None),
        ("\n\n", ("\n\n",), None),
        (["User:", "\n"], ("User:", "\n"), None),
        ([13, 42], None, (13, 42)),
        ([], (), ()),  # an empty list: never stop early (not "the engine's default")
    ],
    ids=["unset", "one-string", "strings", "token-ids", "empty"],
)
async def test_stop_strings_and_stop_tokens_reach_the_runtime_apart(
    gateway, stop, strings, token_ids
) -> None:
    async with gateway() as (client, runtime):
        body = _sample_body([5, 6, 7])
        body["sampling_params"]["stop"] = stop
        r = await _asample(client, body)
        assert r.status_code == 200, r.text
        await _result(client, r.json()["request_id"])
        [params] = runtime.sampled_with
        assert params.stop_strings == strings and params.stop_token_ids == token_ids


async def test_a_stop_list_mixing_strings_and_token_ids_is_refused(gateway) -> None:
    async with gateway() as (client, runtime):
        body = _sample_body([5, 6, 7])
        body["sampling_params"]["stop"] = ["User:", 13]
        r = await _asample(client, body)
        assert r.status_code == 400 and "sampling_params.stop" in r.json()["detail"]
        assert runtime.sampled_with == []


# --- the model's context length ---------------------------------------------------------------------


async def test_a_prompt_must_be_shorter_than_the_models_context(gateway) -> None:
    async with gateway() as (client, runtime):
        r = await _asample(client, _sample_body([7] * MAX_CONTEXT))
        assert r.status_code == 400
        assert f"{MAX_CONTEXT} tokens" in r.json()["detail"] and BASE in r.json()["detail"]
        sampler_id = await _sampler(client)
        r = await _asample(client, _sample_body([7] * (MAX_CONTEXT + 5), sampling_session_id=sampler_id))
        assert r.status_code == 400, "the limit holds for a sampling session too"
        assert runtime.count("sample") == 0

        r = await _asample(client, _sample_body([7] * (MAX_CONTEXT - 1)))
        assert r.status_code == 200, r.text
        assert (await _result(client, r.json()["request_id"])).status_code == 200


async def test_an_openai_prompt_must_be_shorter_than_the_models_context(gateway) -> None:
    async with gateway() as (client, runtime):
        body = {"model": BASE, "prompt": [7] * MAX_CONTEXT, "max_tokens": 2}
        r = await client.post("/v1/completions", json=body, headers=BEARER)
        assert r.status_code == 400 and f"{MAX_CONTEXT} tokens" in r.json()["error"]["message"]
        assert runtime.count("sample") == 0
        r = await client.post(
            "/v1/completions", json={**body, "prompt": [7] * (MAX_CONTEXT - 1)}, headers=BEARER
        )
        assert r.status_code == 200, r.text
        assert runtime.count("sample") == 1


# --- max_concurrent_samples -------------------------------------------------------------------------


async def test_at_most_max_concurrent_samples_run_at_once_and_the_rest_wait(gateway) -> None:
    async with gateway(max_concurrent_samples=2) as (client, runtime):
        runtime.sample_gate.clear()
        request_ids = [(await _asample(client, _sample_body([9, i]))).json()["request_id"] for i in range(5)]
        await _until(lambda: runtime.samples_in_flight == 2, "two samples running")
        await asyncio.sleep(0.2)  # room for a third to start, were the bound missing
        assert runtime.samples_in_flight == 2 and runtime.most_samples_in_flight == 2
        runtime.sample_gate.set()
        for request_id in request_ids:
            assert (await _result(client, request_id)).status_code == 200
        assert runtime.count("sample") == 5 and runtime.most_samples_in_flight == 2


async def test_openai_completions_share_the_sample_bound_with_asample(gateway) -> None:
    async with gateway(max_concurrent_samples=1) as (client, runtime):
        runtime.sample_gate.clear()
        tinker_sample = (await _asample(client, _sample_body([9, 1]))).json()["request_id"]
        await _until(lambda: runtime.samples_in_flight == 1, "the asample running")
        body = {"model": BASE, "prompt": [9, 2], "max_tokens": 2}
        completion = asyncio.create_task(client.post("/v1/completions", json=body, headers=BEARER))
        await asyncio.sleep(0.2)  # room for the completion to start, were it not bounded
        assert runtime.samples_in_flight == 1 and not completion.done()
        runtime.sample_gate.set()
        assert (await completion).status_code == 200
        assert (await _result(client, tinker_sample)).status_code == 200
        assert runtime.most_samples_in_flight == 1 and runtime.count("sample") == 2


class TwoLaneRuntime(GatedRuntime):
    """The gated double serving two base models on separate engines, as a catalog job's two instances:
    each its own sampling lane (`sampling_lane`). Only BASE's samples wait at the gate."""

    def model_cards(self) -> list[Any]:
        (card,) = super().model_cards()
        return [card, dataclasses.replace(card, name=OTHER_BASE)]

    timed_out_lanes: list[tuple[str, str]]

    def sampling_lane(self, target: Any) -> str:
        return f"instance-of-{target.base_model}"

    def sampling_lane_timed_out(self, lane: str, cause: str) -> None:
        self.timed_out_lanes.append((lane, cause))

    async def sample(self, target: Any, prompt: list[int], params: SamplingParams, *args: Any, **kwargs: Any):
        if target.base_model == OTHER_BASE:
            return await DoubleRuntime.sample(self, target, prompt, params, *args, **kwargs)
        return await super().sample(target, prompt, params, *args, **kwargs)


async def test_each_sampling_lane_has_its_own_bound_and_a_cut_sample_frees_its_slot(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    runtime = TwoLaneRuntime(str(tiny_model_dir))
    runtime.timed_out_lanes = []
    app = double_app(
        tmp_path, runtime, {KEY: "alpha"}, long_poll_s=0.2, max_concurrent_samples=1, execution_timeout_s=1.0
    )
    async with asgi_client(app) as client:
        runtime.sample_gate.clear()
        stuck = (await _asample(client, _sample_body([5, 6]))).json()["request_id"]
        await _until(lambda: runtime.samples_in_flight == 1, "BASE's one slot taken")
        waiting = (await _asample(client, _sample_body([5, 7]))).json()["request_id"]
        other = (await _asample(client, _sample_body([5, 8], base_model=OTHER_BASE))).json()["request_id"]
        assert (await _result(client, other)).status_code == 200  # its own lane: not behind BASE's
        assert runtime.samples_in_flight == 1 and len(runtime.sampled_with) == 1  # `waiting` waits
        assert "Sample ran longer than" in (await _failure(client, stuck))["error"]
        # the runtime heard which lane the cut sample hung on (a catalog job quarantines that instance)
        assert runtime.timed_out_lanes == [
            (f"instance-of-{BASE}", "Sample ran past the execution timeout (1 s)")
        ]
        runtime.sample_gate.set()  # the cut sample freed BASE's slot: `waiting` runs
        assert (await _result(client, waiting)).status_code == 200
        assert runtime.most_samples_in_flight == 1 and app.state.gateway.sampling.slots.lanes() == []


# --- queue_timeout ------------------------------------------------------------------------------------


async def test_an_operation_queued_longer_than_queue_timeout_fails_without_running(gateway) -> None:
    async with gateway(queue_timeout_s=0.2) as (client, runtime):
        model_id, created = await _create_model(client)
        await _result(client, created)
        runtime.train_gate.clear()
        running = await _submit_fwdbwd(client, model_id, 1)
        queued = await _submit_fwdbwd(client, model_id, 2)
        await asyncio.sleep(0.4)  # seq 2 waits behind seq 1 past queue_timeout_s
        runtime.train_gate.set()
        assert (await _result(client, running)).status_code == 200
        failure = await _failure(client, queued)
        assert "queue_timeout" in failure["error"] and failure["category"] == "server"
        assert runtime.count("forward_backward") == 1, "the timed-out operation never ran"

        # the queue goes on: the next operation runs
        later = await _submit_fwdbwd(client, model_id, 3)
        assert (await _result(client, later)).status_code == 200
        assert runtime.count("forward_backward") == 2


async def test_an_operation_running_past_execution_timeout_fails_and_frees_its_slot(gateway) -> None:
    async with gateway(execution_timeout_s=0.2, max_concurrent_samples=1) as (client, runtime):
        runtime.sample_gate.clear()
        stuck = (await _asample(client, _sample_body([5, 6]))).json()["request_id"]
        failure = await _failure(client, stuck)
        assert "Sample ran longer than" in failure["error"] and failure["category"] == "server"
        assert runtime.samples_in_flight == 0, "the runtime call is cancelled, not left running"
        runtime.sample_gate.set()
        after = (await _asample(client, _sample_body([5, 7]))).json()["request_id"]
        assert (await _result(client, after)).status_code == 200


async def test_a_gateway_shutting_down_fails_the_operations_it_was_running(gateway) -> None:
    async with gateway() as (client, runtime):
        runtime.sample_gate.clear()
        running = (await _asample(client, _sample_body([5, 6]))).json()["request_id"]
        await _until(lambda: runtime.samples_in_flight == 1, "the sample running")
        await client._transport.app.state.gateway.ops.close()
        # a gateway restarted over the same (Redis) store answers this, instead of a future pending forever
        failure = await _failure(client, running)
        assert "Sample was cancelled (shutdown)" in failure["error"] and failure["category"] == "server"


# --- failure categories -------------------------------------------------------------------------------


def _trainer_failure(cause: BaseException) -> RemoteCommandError:
    """What the Ray runtime raises when a trainer command fails in its cell."""
    return RemoteCommandError.from_exception("forward_backward", cause)


@pytest.mark.parametrize(
    ("failure", "category", "message"),
    [
        (UserError("datum 0: weights has 2 entries, target_tokens 3"), "user", "weights has 2 entries"),
        (_trainer_failure(UserError("datum 0: target_tokens too long")), "user", "UserError: datum 0"),
        (RayTaskError("forward_backward", "remote tb", UserError("datum 1: empty")), "user", "datum 1"),
        (_trainer_failure(RayTaskError("fb", "remote tb", UserError("datum 2: nan"))), "user", "datum 2"),
        (_trainer_failure(RuntimeError("CUDA error: out of memory")), "server", "RuntimeError: CUDA"),
        (RuntimeError("engine socket closed"), "server", "RuntimeError: engine socket closed"),
    ],
    ids=[
        "user-error",
        "trainer-user-error",
        "ray-wrapped-user-error",
        "trainer-ray-wrapped-user-error",
        "trainer-fault",
        "runtime-fault",
    ],
)
async def test_a_failed_training_step_reports_whose_fault_it_was(
    gateway, failure: BaseException, category: str, message: str
) -> None:
    async with gateway() as (client, runtime):
        model_id, created = await _create_model(client)
        await _result(client, created)
        runtime.train_failure = failure
        body = await _failure(client, await _submit_fwdbwd(client, model_id, 1))
        assert body["category"] == category and message in body["error"]
        assert "Traceback" not in body["error"] and "remote tb" not in body["error"]


@pytest.mark.parametrize(
    "failure", [UserError("LoRA rank 4 exceeds this job's cap of 2"), RuntimeError("trainer cell died")]
)
async def test_a_failed_create_leaves_no_model_record(gateway, failure: BaseException) -> None:
    async with gateway() as (client, runtime):
        runtime.create_failure = failure
        model_id, created = await _create_model(client)
        body = await _failure(client, created)
        assert str(failure) in body["error"]
        assert runtime.count("create_model") == 1
        r = await client.post("/api/v1/get_info", json={"model_id": model_id}, headers=HEADERS)
        assert r.status_code == 404, r.text
        assert (await client.get(f"/api/v1/training_runs/{model_id}", headers=HEADERS)).status_code == 404
        runs = (await client.get("/api/v1/training_runs", headers=HEADERS)).json()["training_runs"]
        assert runs == []
