"""Elastic training at the gateway: the runtime sees the count of queued training operations (the
Runtime seam's watch_training_queue), the catalog route carries the runtime's lanes and GPU owners, and
`launcher status` renders them: every GPU with its owner; lanes, loan states and shortfalls in the
caption."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from launcher.elastic_status import elastic_caption, elastic_rows, elastic_table
from tests.fast.gateway.runtime_double import DoubleRuntime, asgi_client, double_app

KEY = "tml-elastic-key-0001"

STATUS = {
    "enabled": True,
    "epoch": 3,
    "lanes": ["core", "lane-engine cell 0"],
    "engines": {"engine cell 0": "lent", "engine cell 1": "serving"},
    "owners": {"10.0.0.2:1": "lane:lane-engine cell 0", "10.0.0.2:2": "engine:engine cell 1"},
    "shortfalls": ["engine cell 1: still had requests running after 30 s"],
    "recent": [],
}


def test_every_gpu_is_a_row_with_its_owner_and_the_caption_says_lanes_loans_and_shortfalls() -> None:
    assert elastic_rows(STATUS) == [
        ("10.0.0.2:1", "lane:lane-engine cell 0"),
        ("10.0.0.2:2", "engine:engine cell 1"),
    ]
    caption = elastic_caption(STATUS)
    assert "lanes (epoch 3): core, lane-engine cell 0" in caption
    assert "engine cell 0: lent, engine cell 1: serving" in caption
    assert "not freed: engine cell 1: still had requests running" in caption
    console = Console(width=200, record=True)
    console.print(elastic_table(STATUS))
    text = console.export_text()
    assert "lane:lane-engine cell 0" in text and "elastic: GPU owners" in text


def test_no_lanes_and_no_engines_are_said_so() -> None:
    caption = elastic_caption({"epoch": 0, "lanes": [], "engines": {}, "owners": {}})
    assert caption == "lanes (epoch 0): none; engines: none"


class ElasticDouble(DoubleRuntime):
    """The gateway's runtime double with the Ray runtime's two elastic hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: Callable[[], int] | None = None

    def watch_training_queue(self, waiting: Callable[[], int]) -> None:
        self.waiting = waiting

    def elastic_status(self) -> dict:
        return STATUS


async def test_the_runtime_sees_queued_training_and_the_catalog_route_shows_lanes(tmp_path: Path) -> None:
    runtime = ElasticDouble()
    app = double_app(tmp_path, runtime, {KEY: "alpha"})
    assert runtime.waiting is not None and runtime.waiting() == 0
    queue = app.state.gateway.ops.queue_for("model-a", first_seq=0)
    ran: list[int] = []

    async def job(seq: int) -> None:
        ran.append(seq)

    async def reject(message: str) -> None:
        raise AssertionError(message)

    async with asgi_client(app) as client:
        for seq in (2, 1):  # waiting for seq 0: both stay queued
            await queue.submit(seq, lambda seq=seq: job(seq), reject)
        assert runtime.waiting() == 2
        await queue.submit(0, lambda: job(0), reject)
        for _ in range(100):
            if len(ran) == 3:
                break
            await asyncio.sleep(0.01)
        assert ran == [0, 1, 2] and runtime.waiting() == 0
        shown = (await client.get("/api/v1/catalog", headers={"X-API-Key": KEY})).json()
    assert shown["elastic"] == STATUS and shown["models"][0]["resident"] is True
    async with asgi_client(double_app(tmp_path, DoubleRuntime(), {KEY: "alpha"})) as client:
        plain = (await client.get("/api/v1/catalog", headers={"X-API-Key": KEY})).json()
    assert "elastic" not in plain  # elastic training off: nothing added
