"""A catalog job's runtime side in one test process: the router of bench/tiny_catalog.py (the real
RayInstanceBackend on a local Ray with logical GPUs, the real CatalogController, the CatalogRuntime) and
the gateway on loopback, all on one event loop in a thread (uvicorn's), so the tinker SDK can drive it
from the test's thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import ray

from miles.checkpoints.manager import CheckpointManager
from miles.contract.ports import claim_port
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.server import embedded_gateway_server
from miles.gateway.settings import GatewaySettings
from miles.runtime.catalog_runtime import CatalogRuntime
from miles.state import MemoryStateStore

T = TypeVar("T")
KEY = "tml-catalog-tests-0001"


class CatalogStack:
    """The router and the gateway serving it, on one loop in a thread; `call` runs a coroutine there.
    `settings`: the gateway's (a test may change a limit of the running gateway through it)."""

    def __init__(
        self, router: CatalogRuntime, workdir: Path, settings: GatewaySettings | None = None
    ) -> None:
        self.router = router
        self.workdir = workdir
        self.settings = settings or GatewaySettings()
        self.port = claim_port("GATEWAY_PORT")  # bound once the router has started its cells
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._server = None
        self.app = None  # the gateway's FastAPI app, once started
        self._thread = threading.Thread(target=self._run, name="catalog-gateway", daemon=True)

    def start(self) -> CatalogStack:
        self._thread.start()
        if not self._ready.wait(180) or self._failure is not None:
            raise RuntimeError(f"the catalog gateway did not start: {self._failure!r}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start()
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.router.start()
        store = MemoryStateStore()
        self.app = app = create_app(
            self.router,
            store,
            CheckpointManager(self.workdir / "checkpoints", store),
            ApiKeys({KEY: "alice"}),
            self.settings,
            owns_runtime=True,
        )
        self._server = embedded_gateway_server(app, "127.0.0.1", self.port)
        serving = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if serving.done():
                await serving
            await asyncio.sleep(0.05)
        self._ready.set()
        await serving

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)


# ---- the gateway's calls the SDK lacks ----------------------------------------------------------------


def unload(stack: CatalogStack, model_id: str) -> None:
    """The gateway's unload_model (the SDK has no call for it), waited for through its future."""
    with httpx.Client(base_url=stack.url, headers={"X-API-Key": KEY}, trust_env=False, timeout=60) as http:
        request_id = http.post("/api/v1/unload_model", json={"model_id": model_id}).json()["request_id"]
        for _ in range(60):
            answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
            if answer.get("type") != "try_again":
                assert answer.get("model_id") == model_id, answer
                return
    raise AssertionError(f"unload of {model_id} never resolved")


# ---- what an instance leaves behind -------------------------------------------------------------------


def live_placement_groups() -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


def alive_actor_count() -> int:
    """From the GCS actor table (the state API needs the dashboard, which the tests' Ray leaves out)."""
    from ray._private.state import actors

    return sum(1 for actor in actors().values() if actor["State"] == "ALIVE")


async def engine_pids(router: CatalogRuntime) -> list[int]:
    """The engine server processes of every running instance (the engine cells' children). An instance
    stays listed while it is torn down (another cycle's release): its cells' actors already gone, or going
    while asked, have no process to report."""
    cells = [
        cell for r in router.backend.running().values() for cell in r.cells.engines if cell.actor is not None
    ]
    answers = await asyncio.gather(*(cell.actor.pid.remote() for cell in cells), return_exceptions=True)
    return [pid for pid in answers if isinstance(pid, int) and pid]


def kill_trainer(router: CatalogRuntime, model: str) -> str:
    """Kill the trainer actor of `model`'s running instance (as a node losing it would); its instance id."""
    (running,) = [r for r in router.backend.running().values() if r.spec.model.name == model]
    for actor in running.cells.trainer_cell.actors:
        ray.kill(actor, no_restart=True)
    return running.spec.instance_id


def running_pids(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def free_resources() -> dict[str, float]:
    """Ray's free GPUs and CPUs (placement-group and node-pin resources left out)."""
    free = ray.available_resources()
    return {name: free.get(name, 0.0) for name in ("GPU", "CPU")}


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Ray's resource view and actor table settle within a report period; bounded."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.1)
