"""Engine cells from placed bundles (no Ray, no process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.cluster.ordering import BundleLocation
from miles.engines.config import EngineConfig
from miles.rollout.engine_cell import EngineCell, engine_cells_for


def test_cells_from_allocated_engine_bundles(tmp_path: Path) -> None:
    config = EngineConfig(model_path=str(tmp_path), gpus_per_engine=2)
    groups = [
        [BundleLocation(4, "10.0.0.3", 0), BundleLocation(2, "10.0.0.3", 1)],
        [BundleLocation(0, "10.0.0.1", 0), BundleLocation(1, "10.0.0.1", 1)],
    ]
    pg = object()
    cells = engine_cells_for(pg, groups, config)  # type: ignore[arg-type]
    assert [(c.index, c.bundle, c.gpu_ids) for c in cells] == [(0, (pg, 4), (0, 1)), (1, (pg, 0), (0, 1))]
    with pytest.raises(ValueError, match="gpus_per_engine is 2"):
        EngineCell(0, config, gpu_ids=[0])
