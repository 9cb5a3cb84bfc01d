"""The driver builds the tiny model in the shape the preset names (`model.init_shape`; a catalog entry's
`init_shape`), once per run directory. The build itself is replaced: the 0.6B shape's weights take ~15 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.presets import load_preset
from miles.contract.preset.catalog import effective_catalog
from miles.models import tiny
from miles.models.tiny import TINY_SHAPES, TinyModelSpec


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, TinyModelSpec]]:
    """Each build_tiny_model call as (directory, spec); it writes only config.json (what the callers test)."""
    calls: list[tuple[Path, TinyModelSpec]] = []

    def fake_build(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        calls.append((out, spec or TinyModelSpec()))
        return out

    monkeypatch.setattr(tiny, "build_tiny_model", fake_build)
    return calls


@pytest.mark.parametrize("shape", ["tiny", "qwen3-0.6b"])
def test_the_resident_model_is_built_in_the_presets_shape(
    tmp_path: Path, builds: list[tuple[Path, TinyModelSpec]], shape: str
) -> None:
    from miles.driver.bringup import resolve_model_dir

    preset = load_preset("tiny-cpu", [f"model.init_shape={shape}"], env={})
    model = resolve_model_dir(preset, tmp_path)
    assert builds == [(tmp_path / "model", TINY_SHAPES[shape])]
    assert model.directory == (tmp_path / "model").resolve()
    resolve_model_dir(preset, tmp_path)  # a restarted driver finds it built
    assert len(builds) == 1


def test_catalog_models_of_two_shapes_get_a_directory_each(
    tmp_path: Path, builds: list[tuple[Path, TinyModelSpec]]
) -> None:
    from miles.driver.catalog import catalog_model_dir

    catalog = (
        "catalog=[{name: a, init: tiny}, {name: b, init: tiny, init_shape: qwen3-0.6b},"
        " {name: c, init: tiny, init_shape: qwen3-0.6b}]"
    )
    models = effective_catalog(load_preset("tiny-cpu", [catalog, "model.name=a"], env={}))
    dirs = [catalog_model_dir(model, tmp_path)[0] for model in models]
    assert dirs == [(tmp_path / "model").resolve()] + [(tmp_path / "model-qwen3-0.6b").resolve()] * 2
    assert builds == [
        (tmp_path / "model", TINY_SHAPES["tiny"]),
        (tmp_path / "model-qwen3-0.6b", TINY_SHAPES["qwen3-0.6b"]),
    ]
