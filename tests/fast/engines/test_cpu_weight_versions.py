"""Which weight version sampled which tokens (miles/engines/cpu/versions.py), as SGLang 0.5.23 reports it:
the span rules on plain data, then the CPU engine through its HTTP routes: a request running across an
in-place update (pause in_place, new version without aborting, continue) finishes with two spans split
where it paused; a request that never saw a change has one; the OpenAI route's metadata carries them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.engines.cpu.requests import Phase
from miles.engines.cpu.server import create_app
from miles.engines.cpu.versions import VersionEvent, finished_meta, record_change, version_spans
from miles.engines.sglang_client import SGLangApiClient
from miles.utils.http import close_clients
from miles.utils.serving import ServerThread
from tests.fast.engines.conftest import wait_healthy

PROMPT = [3, 14, 15, 92, 65]


def test_spans_follow_sglangs_rules() -> None:
    assert version_spans([], "v1", 5) == [{"version": "v1", "start": 0, "end": 5}]
    events: list[VersionEvent] = []
    record_change(events, "v0", 0)  # no token yet: nothing to attribute
    assert events == []
    record_change(events, "v1", 3)
    record_change(events, "v2", 3)  # two changes with no token between: v2 sampled nothing
    record_change(events, "v3", 7)
    assert version_spans(events, "v4", 9) == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v3", "start": 3, "end": 7},
        {"version": "v4", "start": 7, "end": 9},
    ]
    # equal neighbours merge; a change after the last token adds no empty span
    merged = version_spans([VersionEvent("a", 2), VersionEvent("a", 4)], "b", 4)
    assert merged == [{"version": "a", "start": 0, "end": 4}]
    meta = finished_meta([VersionEvent("a", 2)], "b", 6)
    assert meta["weight_version"] == "b" and [s["version"] for s in meta["weight_versions"]] == ["a", "b"]
    assert finished_meta([], "b", 0) == {
        "weight_versions": [{"version": "b", "start": 0, "end": 0}],
        "weight_version": "b",
    }


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[tuple[str, object]]:
    app = create_app(str(tiny_model_dir), served_model_name="tiny")
    with ServerThread(app) as srv:
        wait_healthy(srv.url)
        yield srv.url, app.state.engine


async def _running(engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.count(frozenset({Phase.RUNNING})) < 1:
        assert time.monotonic() < deadline, "the request never ran"
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # a few tokens under the first version


async def _in_place_update(client: SGLangApiClient, version: str) -> None:
    await client.pause_generation("in_place")
    await client.begin_weight_update()
    await client.update_weight_version(version, abort_all_requests=False)
    await client.end_weight_update()
    await client.continue_generation()


async def test_a_request_across_an_in_place_update_reports_both_versions(engine_url) -> None:
    url, engine = engine_url
    client = SGLangApiClient(url)
    try:
        params = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}
        before = engine.weight_version
        task = asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=params))
        await _running(engine)
        await _in_place_update(client, "v-in-place")
        out = await task
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 200, "not aborted"
        first, second = meta["weight_versions"]
        assert (first["version"], first["start"], second["version"], second["end"]) == (
            before,
            0,
            "v-in-place",
            200,
        )
        assert 0 < first["end"] == second["start"] < 200
        assert meta["weight_version"] == "v-in-place"
        again = await client.generate(input_ids=PROMPT, sampling_params={**params, "max_new_tokens": 4})
        assert again["meta_info"]["weight_versions"] == [{"version": "v-in-place", "start": 0, "end": 4}]
    finally:
        await close_clients()


async def test_the_openai_route_reports_the_spans_in_its_metadata(engine_url) -> None:
    url, engine = engine_url
    client = SGLangApiClient(url)
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            await _running(engine)
            await _in_place_update(client, "v-openai")
            answer = (await task).json()
        metadata = answer["metadata"]
        assert metadata["weight_version"] == "v-openai"
        assert [s["version"] for s in metadata["weight_versions"]][-1] == "v-openai"
        assert len(metadata["weight_versions"]) == 2
    finally:
        await close_clients()
