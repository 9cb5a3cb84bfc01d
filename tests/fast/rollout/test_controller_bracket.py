"""The weight-update bracket and the health checker on the real InferenceController (engines faked).

The cells are EngineCell with start/stop replaced (no Ray, no process): the state machine, the lock, the
health-check bookkeeping and the respawn path are the real ones.
"""

from __future__ import annotations

import asyncio

import pytest

from miles.contract import events
from miles.contract.events import read_events
from miles.engines.config import EngineConfig
from miles.errors import IllegalTransition
from miles.observability.metrics import job_metrics
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController, NoEnginesError
from miles.rollout.engine_cell import EngineCell
from miles.rollout.health import HealthCheckConfig


class FakeClient:
    def __init__(self, name: str) -> None:
        self.base_url = f"http://{name}"
        self.healthy = True

    async def health(self, timeout_s: float | None = None) -> bool:
        return self.healthy


class FakeCell(EngineCell):
    """EngineCell whose engine 'starts' instantly (or when `release_start` is set)."""

    def __init__(self, index: int, config: EngineConfig) -> None:
        super().__init__(index, config)
        self.release_start = asyncio.Event()
        self.release_start.set()

    async def start(self) -> None:
        self.transition(CellState.STARTING)
        self.starts += 1
        await self.release_start.wait()
        self.client = FakeClient(f"{self.name}-{self.starts}")  # type: ignore[assignment]
        self.transition(CellState.PENDING_WEIGHTS)

    async def restart(self) -> None:
        await self.start()

    async def stop(self) -> None:
        self.transition(CellState.STOPPED)


FAST_HEALTH = HealthCheckConfig(interval_s=0.02, timeout_s=0.5, failure_threshold=3)


@pytest.fixture
async def controller(tmp_path):
    config = EngineConfig(model_path=str(tmp_path))
    controller = InferenceController([FakeCell(i, config) for i in range(2)], health=FAST_HEALTH)
    await controller.start()
    yield controller
    await controller.stop()


def states(controller: InferenceController) -> list[CellState]:
    return [cell.state for cell in controller.cells]


async def test_engines_are_routed_to_only_after_a_successful_push(controller) -> None:
    assert controller.ready_engines() == []
    async with controller.weight_update() as update:
        assert update.version == 1 and len(update.engines) == 2
        assert controller.update_in_progress
    assert states(controller) == [CellState.READY] * 2
    assert controller.ready_engines() == [c.client for c in controller.cells]
    assert controller.weight_version == 1 and not controller.update_in_progress


@pytest.mark.parametrize("health_running", [True, False])
async def test_exception_aborts_and_the_next_push_succeeds(controller, health_running) -> None:
    if health_running:
        controller.start_health_checks()
    async with controller.weight_update():
        pass
    with pytest.raises(RuntimeError, match="trainer failed"):
        async with controller.weight_update():
            assert not controller.health.running  # paused during the push
            assert controller.ready_engines() == []  # half-updated engines are not routed to
            raise RuntimeError("trainer failed before bucket 2")
    assert not controller.update_in_progress
    assert states(controller) == [CellState.PENDING_WEIGHTS] * 2
    assert controller.health.running is health_running
    assert controller.weight_version == 1
    async with controller.weight_update() as update:
        assert update.version == 2
    assert states(controller) == [CellState.READY] * 2 and controller.weight_version == 2


async def test_cancellation_inside_the_bracket_aborts(controller) -> None:
    controller.start_health_checks()
    entered = asyncio.Event()

    async def push() -> None:
        async with controller.weight_update():
            entered.set()
            await asyncio.sleep(60)  # a bucket in flight

    task = asyncio.create_task(push())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not controller.update_in_progress
    assert controller.health.running
    assert controller.ready_engines() == []
    async with controller.weight_update():
        pass
    assert states(controller) == [CellState.READY] * 2


async def test_waiting_for_a_starting_cell_releases_the_lock_between_polls(controller) -> None:
    controller.start_health_checks()
    slow = controller.cells[1]
    slow.release_start.clear()
    slow.mark_failed("test")
    restart = asyncio.create_task(slow.restart())
    await asyncio.sleep(0)
    assert slow.state is CellState.STARTING

    push = asyncio.create_task(controller.weight_update().__aenter__())
    await asyncio.sleep(0.5)
    assert not push.done()
    assert not controller.update_in_progress  # lock not held while waiting
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await push
    assert not controller.update_in_progress and controller.health.running
    assert controller.ready_engines() == []

    slow.release_start.set()
    await restart
    async with controller.weight_update() as update:
        assert {c.index for c in update.engines} == {0, 1}
    assert states(controller) == [CellState.READY] * 2


async def test_waiting_times_out_with_the_names_of_starting_cells(controller) -> None:
    cell = controller.cells[0]
    cell.release_start.clear()
    cell.mark_failed("test")
    restart = asyncio.create_task(cell.restart())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError, match="engine cell 0"):
        async with controller.weight_update(wait_timeout_s=0.3):
            pass
    assert not controller.update_in_progress
    cell.release_start.set()
    await restart


async def test_no_serving_engine_is_an_error_and_releases_the_lock(controller) -> None:
    for cell in controller.cells:
        cell.mark_failed("gone")
    with pytest.raises(NoEnginesError):
        async with controller.weight_update():
            pass
    assert not controller.update_in_progress


async def test_failing_engine_is_respawned_and_gets_weights_before_routing(
    controller, tmp_path, monkeypatch
) -> None:
    pushes: list[list[int]] = []
    registry = job_metrics().registry
    respawned_before = registry.get_sample_value("miles_engine_respawns_total", {"engine": "0"}) or 0.0
    monkeypatch.setattr(events, "_current", events.EventLog(tmp_path))  # restored after the test

    async def refresher(ctrl: InferenceController) -> None:
        async with ctrl.weight_update() as update:
            pushes.append([c.starts for c in update.engines])

    controller.set_weight_refresher(refresher)
    await refresher(controller)
    controller.start_health_checks()
    sick = controller.cells[0]
    sick.client.healthy = False
    for _ in range(200):
        await asyncio.sleep(0.02)
        if sick.starts == 2 and sick.state is CellState.READY:
            break
    await controller.health.wait_handled()
    assert sick.starts == 2 and sick.state is CellState.READY
    assert pushes[-1] == [2, 1]  # the respawned engine was in the push that made it ready
    assert controller.health.running and not controller.update_in_progress
    assert controller.ready_engines() == [c.client for c in controller.cells]
    # the respawn in the metrics and the run's event log
    assert registry.get_sample_value("miles_engine_respawns_total", {"engine": "0"}) == respawned_before + 1
    assert registry.get_sample_value("miles_engine_state", {"engine": "0", "state": "ready"}) == 1
    assert registry.get_sample_value("miles_engine_state", {"engine": "0", "state": "failed"}) == 0
    engine_0 = [e for e in read_events(tmp_path) if e["kind"] == "engine" and e["engine"] == 0]
    moves = [(e["old"], e["new"]) for e in engine_0]
    assert moves[-4:] == [("ready", "failed"), ("failed", "starting"), ("starting", "pending_weights"),
                          ("pending_weights", "ready")]  # fmt: skip


async def test_fewer_failures_than_the_threshold_do_not_respawn(controller) -> None:
    cell = controller.cells[1]
    probes = iter([False, False, True, False, False, True])

    async def flaky(timeout_s: float | None = None) -> bool:
        return next(probes, True)

    cell.client.health = flaky  # type: ignore[method-assign]
    for _ in range(6):
        await controller.health.check_once()
    assert cell.starts == 1


async def test_a_failed_respawn_is_retried(controller) -> None:
    cell = controller.cells[0]
    attempts = 0
    original_start = cell.start

    async def start_fails_once() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            cell.transition(CellState.STARTING)
            cell.mark_failed("start failed")  # what EngineCell.start does when its engine cannot start
            raise RuntimeError("no GPU memory")
        await original_start()

    cell.start = start_fails_once  # type: ignore[method-assign]
    cell.mark_failed("killed")
    controller.start_health_checks()
    for _ in range(300):
        await asyncio.sleep(0.02)
        if cell.state is CellState.READY:
            break
    await controller.health.wait_handled()
    assert attempts == 2 and cell.state is CellState.READY


def test_illegal_transitions_are_refused(tmp_path) -> None:
    cell = EngineCell(0, EngineConfig(model_path=str(tmp_path)))
    with pytest.raises(IllegalTransition, match="new -> ready"):
        cell.mark_ready()


async def test_adapters_are_published_and_reloaded(controller, tmp_path) -> None:
    from miles.engines.errors import EngineRefused
    from miles.weights.push import publish_adapter_dir, reload_published_adapters, unload_adapter

    loaded: dict[str, dict[str, str]] = {}

    def lora_client(cell: EngineCell) -> None:
        table = loaded.setdefault(cell.client.base_url, {})

        async def load(name: str, path: str) -> dict:
            if name in table:
                raise EngineRefused("already loaded", status_code=400, endpoint="/load_lora_adapter", body={})
            table[name] = path
            return {"success": True}

        async def unload(name: str) -> dict:
            if table.pop(name, None) is None:
                raise EngineRefused("not loaded", status_code=400, endpoint="/unload_lora_adapter", body={})
            return {"success": True}

        cell.client.load_lora_adapter = load  # type: ignore[attr-defined]
        cell.client.unload_lora_adapter = unload  # type: ignore[attr-defined]

    for cell in controller.cells:
        lora_client(cell)
    a_dir, b_dir = tmp_path / "a-v1", tmp_path / "b-v3"
    a_dir.mkdir()
    b_dir.mkdir()
    gone = tmp_path / "deleted-checkpoint"
    controller.published_adapters.update({"a": str(a_dir), "b": str(b_dir), "x": str(gone)})
    await reload_published_adapters(controller)  # replaces what is loaded, loads what is missing
    await reload_published_adapters(controller)
    assert list(loaded.values()) == [{"a": str(a_dir), "b": str(b_dir)}] * 2
    assert "x" not in controller.published_adapters  # its directory is gone: dropped, not a failure
    assert states(controller) == [CellState.READY] * 2

    with pytest.raises(ValueError, match="does not exist"):
        await publish_adapter_dir(controller, lora_name="c", path="/nonexistent/c")
    await publish_adapter_dir(controller, lora_name="a", path=tmp_path)
    await unload_adapter(controller, lora_name="b")
    assert list(loaded.values()) == [{"a": str(tmp_path.resolve())}] * 2
    assert controller.published_adapters == {"a": str(tmp_path.resolve())}


async def test_a_failed_adapter_update_leaves_ready_engines_serving(controller) -> None:
    """LoRA loads/unloads never touch the base weights: a refused adapter must not un-route healthy
    engines (every tenant's sampling would stall until the next successful update)."""
    async with controller.weight_update():
        pass
    with pytest.raises(RuntimeError, match="adapter refused"):
        async with controller.weight_update(base_weights=False):
            assert controller.ready_engines() == [c.client for c in controller.cells]  # still routed to
            raise RuntimeError("adapter refused by the engine")
    assert states(controller) == [CellState.READY] * 2 and not controller.update_in_progress
    # a respawned engine (waiting for weights) becomes READY through an adapter-only refresh
    controller.cells[0].mark_pending()
    async with controller.weight_update(base_weights=False):
        assert controller.ready_engines() == [controller.cells[1].client]
    assert states(controller) == [CellState.READY] * 2


async def test_a_request_that_finds_its_engine_dead_takes_it_out_of_routing_at_once(controller) -> None:
    """report_failure: a reset with the engine still answering changes nothing; an engine that does not
    answer either is FAILED (no longer routed to) and respawned now, not after `failure_threshold` probe
    rounds; a stale report (the engine was respawned since) is ignored."""

    async def refresher(ctrl: InferenceController) -> None:
        async with ctrl.weight_update():
            pass

    controller.set_weight_refresher(refresher)
    await refresher(controller)
    controller.health.config = HealthCheckConfig(interval_s=30, timeout_s=0.5, failure_threshold=3)
    controller.start_health_checks()
    cell = controller.cells[0]
    old = cell.client
    await controller.report_failure(cell, old, "ReadError while sampling")
    assert cell.state is CellState.READY and cell.starts == 1  # the engine answers: one bad connection

    old.healthy = False
    await controller.report_failure(cell, old, "RemoteProtocolError while sampling")
    assert old not in controller.ready_engines()
    await controller.health.wait_handled()
    assert cell.starts == 2 and cell.state is CellState.READY and cell.client is not old
    await controller.report_failure(cell, old, "a late report about the old process")
    assert cell.state is CellState.READY and cell.starts == 2
