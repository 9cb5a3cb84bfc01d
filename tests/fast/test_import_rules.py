"""The package rules are import-linter contracts in pyproject.toml, checked by `make lint` (and so in CI).
These tests keep the contracts honest: every package under miles/ sits in a layer, and the lists that say
"everything of miles but the contract" name every package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def _contract(starting: str) -> dict:
    found = [c for name, c in _contracts().items() if name.startswith(starting)]
    assert len(found) == 1, f"no single contract named {starting!r}…: {list(_contracts())}"
    return found[0]


def miles_packages() -> set[str]:
    """Every package and top-level module directly under miles/."""
    names = set()
    for path in (ROOT / "miles").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            names.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            names.add(path.stem)
    return names


def layered(layers: list[str]) -> list[str]:
    """The package names of a layers contract (siblings split on | and :)."""
    return [name for layer in layers for name in re.split(r"\s*[|:]\s*", layer.strip())]


def test_every_package_of_miles_sits_in_exactly_one_layer() -> None:
    names = layered(_contract("miles: packages from the driver")["layers"])
    assert sorted(set(names)) == sorted(names), "a package is named in two layers"
    assert set(names) == miles_packages(), "place each new package of miles/ in a layer of pyproject.toml"


@pytest.mark.parametrize("starting", ["the launcher sees the job only", "miles.contract is pure"])
def test_the_everything_but_the_contract_lists_name_every_other_package(starting: str) -> None:
    forbidden = {m.removeprefix("miles.") for m in _contract(starting)["forbidden_modules"] if "." in m}
    assert forbidden == miles_packages() - {"contract"}


def test_the_gateway_may_not_reach_any_package_below_the_seam_that_runs_models() -> None:
    forbidden = set(_contract("the gateway reaches models only")["forbidden_modules"])
    assert {"miles.runtime", "miles.train", "miles.rollout", "miles.engines", "miles.weights"} <= forbidden
