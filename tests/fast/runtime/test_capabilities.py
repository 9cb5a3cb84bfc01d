"""Optional runtime capabilities (miles.seam.capabilities): a runtime without one is treated as lacking it,
a runtime with one is asked, a runtime with half of one is treated as lacking it, and the metered wrapper
answers exactly as the runtime it wraps would (nothing more, nothing hidden). The driver's probe loop asks
the runtime's declared probe contract (SupervisedRuntime)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miles.contract.exit_codes import JobExit
from miles.contract.preset.files import validate_preset
from miles.driver import serve
from miles.observability.metrics import JobMetrics, job_metrics
from miles.runtime.metered import MeteredRuntime
from miles.seam.capabilities import ElasticTraining, ModelCatalog, OperationTimeouts, SamplingLanes
from miles.seam.requests import ForwardBackwardRequest
from miles.seam.runtime import (
    ONE_LANE,
    SamplerTarget,
    SupervisedRuntime,
    catalog_of,
    elastic_of,
    report_operation_timeout,
    report_sampling_timeout,
    sampling_lane_of,
    watch_training_queue,
)
from miles.types import Datum
from tests.fast.gateway.runtime_double import BASE, DoubleRuntime

TARGET = SamplerTarget(BASE)


class Capable(DoubleRuntime, OperationTimeouts, SamplingLanes, ElasticTraining, ModelCatalog):
    """A runtime declaring every optional capability, recording what it is told."""

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple[str, ...]] = []
        self.waiting: Callable[[], int] | None = None

    def operation_timed_out(self, model_id: str, operation: str, cause: str) -> None:
        self.heard.append(("operation", model_id, operation, cause))

    def sampling_lane(self, target: SamplerTarget) -> str:
        return "lane-7"

    def sampling_lane_timed_out(self, lane: str, cause: str) -> None:
        self.heard.append(("lane", lane, cause))

    def watch_training_queue(self, waiting: Callable[[], int]) -> None:
        self.waiting = waiting

    def elastic_status(self) -> dict[str, Any] | None:
        return {"lanes": ["core"]}

    def catalog(self) -> dict[str, Any] | None:
        return {"models": []}


class HalfALane(DoubleRuntime):
    """A lane without its timeout: a lane nothing could quarantine is no lane the gateway may count on."""

    def sampling_lane(self, target: SamplerTarget) -> str:
        return "lane-7"


def _ask_everything(runtime: Any) -> tuple[Any, ...]:
    report_operation_timeout(runtime, "m", "OptimStep", "cut")
    report_sampling_timeout(runtime, "lane-7", "cut")
    watch_training_queue(runtime, lambda: 3)
    return sampling_lane_of(runtime, TARGET), elastic_of(runtime), catalog_of(runtime)


@pytest.mark.parametrize("runtime", [DoubleRuntime(), HalfALane()], ids=["none", "half of one"])
def test_a_runtime_without_a_capability_is_treated_as_lacking_it(runtime: DoubleRuntime) -> None:
    assert not isinstance(runtime, SamplingLanes)
    assert _ask_everything(runtime) == (ONE_LANE, None, None)


def test_a_runtime_declaring_the_capabilities_is_asked() -> None:
    runtime = Capable()
    assert _ask_everything(runtime) == ("lane-7", {"lanes": ["core"]}, {"models": []})
    assert runtime.heard == [("operation", "m", "OptimStep", "cut"), ("lane", "lane-7", "cut")]
    assert runtime.waiting is not None and runtime.waiting() == 3


def test_the_metered_wrapper_answers_as_the_runtime_it_wraps() -> None:
    plain = MeteredRuntime(DoubleRuntime(), JobMetrics())
    assert _ask_everything(plain) == (ONE_LANE, None, None)
    inner = Capable()
    metered = MeteredRuntime(inner, JobMetrics())
    assert _ask_everything(metered) == ("lane-7", {"lanes": ["core"]}, {"models": []})
    assert inner.heard == [("operation", "m", "OptimStep", "cut"), ("lane", "lane-7", "cut")]
    assert inner.waiting is not None and inner.waiting() == 3


async def test_the_metered_wrapper_passes_the_request_on_and_counts_its_tokens() -> None:
    inner = DoubleRuntime()
    await inner.create_model("m", BASE, None)
    metrics = JobMetrics()
    metered = MeteredRuntime(inner, metrics)
    tokens = np.arange(5, dtype=np.int64)
    datum = Datum(tokens, {"target_tokens": tokens, "weights": np.ones(5, dtype=np.float32)})
    await metered.forward_backward(ForwardBackwardRequest("m", [datum], "cross_entropy", {}, True))
    assert inner.calls[-1] == ("forward", "m")  # forward_only reached the runtime
    assert metrics.registry.get_sample_value("miles_train_tokens_total", {"model": "m"}) == 5


class Supervised(DoubleRuntime, SupervisedRuntime):
    """What the driver's probe loop watches: alive for `alive_probes` probes, then dead."""

    def __init__(self, alive_probes: int) -> None:
        super().__init__()
        self.alive_probes = alive_probes
        self.probes = 0

    async def probe_trainers(self, timeout_s: float) -> bool:
        self.probes += 1
        return self.probes <= self.alive_probes

    def trainer_liveness(self) -> list[tuple[int, bool]]:
        return [(0, self.probes <= self.alive_probes), (1, True)]


async def test_the_probe_loop_ends_the_driver_when_the_runtime_says_its_trainers_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "DEAD_GRACE_S", 0.01)
    preset = validate_preset(
        {
            "name": "probe-test",
            "nodes": 1,
            "model": {"name": "m", "init": "tiny"},
            "engines": {"kind": "cpu"},
            "runtime": {"trainer_probe_interval_s": 0.01},
        }
    )
    runtime = Supervised(alive_probes=2)
    code = await asyncio.wait_for(serve.wait_for_shutdown(asyncio.Event(), runtime, preset), 10)
    assert code == JobExit.TRAINER_DEAD and runtime.probes == 3
    alive = job_metrics().registry.get_sample_value
    assert alive("miles_job_trainer_cell_alive", {"cell": "0"}) == 0
    assert alive("miles_job_trainer_cell_alive", {"cell": "1"}) == 1
