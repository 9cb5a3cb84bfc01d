"""What our side of SGLang's HTTP API uses, recorded rather than listed by hand: every request
SGLangApiClient sends (each of its methods called, with the arguments the runtime passes, through an
httpx.MockTransport) and every route the CPU engine's app declares.

Shared by test_sglang_requests.py (the bodies), test_sglang_routes.py (the routes) and
tools/sglang_contract.py --write (the snapshot); needs no sglang.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
from fastapi.routing import APIRoute

from miles.engines import sglang_client
from miles.engines.cpu.server import create_app
from miles.engines.sglang_client import SGLangApiClient, WeightApi
from miles.rollout.sampling import engine_sampling_params
from miles.types import SamplingParams


@dataclass(frozen=True)
class Sent:
    method: str
    path: str
    body: Any  # the decoded JSON body; None without one
    query: dict[str, str]


@dataclass
class Recorder:
    """An httpx transport handler keeping every request and answering each as SGLang would, minimally."""

    requests: list[Sent] = field(default_factory=list)
    called: set[str] = field(default_factory=set)  # the SGLangApiClient methods called

    @property
    def bodies(self) -> list[tuple[str, Any]]:
        return [(r.path, r.body) for r in self.requests if r.body is not None]

    @property
    def queries(self) -> dict[str, dict[str, str]]:
        return {r.path: r.query for r in self.requests if r.query}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append(Sent(request.method, request.url.path, body, dict(request.url.params)))
        if body is None:
            return httpx.Response(200, text="Cache flushed.")
        if request.url.path == "/generate" and body.get("stream"):
            return httpx.Response(200, text='data: {"output_ids": [], "meta_info": {}}\n\ndata: [DONE]\n\n')
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {}})
        return httpx.Response(200, json={"success": True, "message": "ok"})


class _Tracked:
    """The client, noting which of its methods were called (so a new, unexercised one is caught)."""

    def __init__(self, client: SGLangApiClient, called: set[str]) -> None:
        self._client, self._called = client, called

    def __getattr__(self, name: str) -> Any:
        self._called.add(name)
        return getattr(self._client, name)


def client_methods() -> set[str]:
    """The public methods of SGLangApiClient: each one is a request the runtime may send."""
    return {n for n, _ in inspect.getmembers(SGLangApiClient, inspect.isfunction) if not n.startswith("_")}


async def exercise_client(recorder: Recorder, weight_api: WeightApi = "current") -> None:
    """One call of every SGLangApiClient method (several for the bodies that vary), into `recorder`."""
    http = httpx.AsyncClient(transport=httpx.MockTransport(recorder))
    with mock.patch.object(sglang_client, "get_async_client", lambda purpose: http):
        client: Any = _Tracked(
            SGLangApiClient("http://engine:30000", api_key="k", weight_api=weight_api), recorder.called
        )
        await client.health()
        await client.alive()
        await client.model_info()
        await _generate(client)
        await _control(client)
        await _weights(client)
    await http.aclose()


async def _generate(client: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_strings=("\n",), seed=3)
    await client.generate(
        input_ids=[1, 2, 3],
        sampling_params=engine_sampling_params(params, seed=3),
        return_logprob=True,
        lora_path="snap-0123456789abcdef",
        rid="r-1",
        logprob_start_len=0,
    )
    no_stop = SamplingParams(max_tokens=4, stop_strings=(), stop_token_ids=())
    await client.generate(input_ids=[5], sampling_params=engine_sampling_params(no_stop, seed=None))
    await client.generate(  # Tinker's top-k and target prompt logprobs
        input_ids=[1, 2, 3],
        sampling_params=engine_sampling_params(params, seed=None),
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=5,
        token_ids_logprob=[4, 9],
    )
    await client.generate(  # prompt_alt_tokens_k: one-token draws, a batch of prefixes
        input_ids=[[1], [1, 2]],
        sampling_params=[{"max_new_tokens": 1, "temperature": 0.7, "sampling_seed": s} for s in (0, 1)],
        return_logprob=True,
        lora_path="snap-0123456789abcdef",
    )
    async for _ in client.generate_stream(
        input_ids=[1, 2, 3], sampling_params=engine_sampling_params(params, seed=3), return_logprob=True
    ):
        pass


async def _control(client: Any) -> None:
    await client.abort_request("r-1")
    await client.abort_request(abort_all=True)
    for mode in ("abort", "retract", "in_place"):
        await client.pause_generation(mode)
    await client.continue_generation()
    await client.flush_cache(timeout_s=1.5)
    await client.release_memory_occupation(["weights", "kv_cache"])
    await client.resume_memory_occupation(None)
    await client.load_lora_adapter("snap-0123456789abcdef", "/ckpt/adapter")
    await client.unload_lora_adapter("snap-0123456789abcdef")


async def _weights(client: Any) -> None:
    await client.init_weights_update_group(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3, backend="gloo"
    )
    await client.begin_weight_update()
    await client.update_weights_from_distributed(
        names=["w", "b"], dtypes=["bfloat16", "float32"], shapes=[[2, 2], [2]], load_format="flattened_bucket"
    )
    await client.update_weights_from_distributed(
        names=["w"], dtypes=["float32"], shapes=[[4]], flush_cache=True, weight_version="v2"
    )
    await client.update_weights_from_tensor(["cGF5bG9hZA=="], weight_version="v3")
    await client.weights_checker()
    await client.weights_checker(sglang_client.DIGEST_ACTION)
    await client.update_weights_from_tensor(["cGF5bG9hZA=="], load_format="direct", flush_cache=False)
    await client.update_weight_version("v2", abort_all_requests=False)
    await client.end_weight_update()
    await client.destroy_weights_update_group()


def summarize(requests: list[Sent]) -> dict[str, dict[str, list[str]]]:
    """ "METHOD /path" -> the body keys ("body") and query parameters ("query") sent to it, when any."""
    sent: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for request in requests:
        entry = sent[f"{request.method} {request.path}"]
        if isinstance(request.body, dict):
            entry.setdefault("body", set()).update(request.body)
        if request.query:
            entry.setdefault("query", set()).update(request.query)
    return {key: {k: sorted(v) for k, v in entry.items()} for key, entry in sorted(sent.items())}


def client_usage(weight_api: WeightApi = "current") -> dict[str, dict[str, list[str]]]:
    recorder = Recorder()
    asyncio.run(exercise_client(recorder, weight_api))
    return summarize(recorder.requests)


def cpu_engine_routes(**create_app_kwargs: Any) -> set[str]:
    """ "METHOD /path" of every route the CPU engine app declares. FastAPI's own documentation routes
    (/docs, /openapi.json: starlette Routes, not APIRoutes) are left out: SGLang's FastAPI app has them
    too, and they are no part of the API. The app is built without loading a model (that happens on
    startup), so any path will do."""
    app = create_app("/nonexistent-model", **create_app_kwargs)
    return {
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
