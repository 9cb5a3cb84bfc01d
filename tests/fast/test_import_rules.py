"""The package boundaries the architecture promises, checked on the source: the gateway talks to the
runtime only through `miles.runtime.api`, never to trainers, engines, weights or a runtime implementation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "miles" / "gateway"

# What the gateway must never import: the runtime implementations' packages, and the runtime package
# itself except its API module.
FORBIDDEN_FOR_GATEWAY = ("miles.train", "miles.rollout", "miles.engines", "miles.weights", "miles.runtime")
ALLOWED_EXCEPTIONS = ("miles.runtime.api",)


def imported_modules(source: str, module: str) -> set[str]:
    """What each import statement in `source` reaches: `import X` -> X, `from X import y` -> X.y (y may
    be a submodule or a name X re-exports); relative imports resolved against `module`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(names: set[str]) -> list[str]:
    bad = []
    for name in sorted(names):
        if any(_is_under(name, ok) for ok in ALLOWED_EXCEPTIONS):
            continue
        if any(_is_under(name, banned) for banned in FORBIDDEN_FOR_GATEWAY):
            bad.append(name)
    return bad


def _gateway_modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(ROOT).with_suffix("").parts), path)
        for path in sorted(GATEWAY.rglob("*.py"))
    ]


def test_the_gateway_imports_only_the_runtime_api() -> None:
    modules = _gateway_modules()
    assert len(modules) > 10, "the gateway's modules were not found"
    found = {
        module: bad
        for module, path in modules
        if (bad := violations(imported_modules(path.read_text(), module)))
    }
    assert found == {}, f"gateway modules import past the runtime API: {found}"


@pytest.mark.parametrize(
    "line",
    [
        "from miles.train.errors import RemoteCommandError",
        "import miles.engines.sglang_client",
        "from miles.runtime.local import LocalRuntime",
        "from miles.runtime import ray_runtime",
        "from miles import weights",
        "def f():\n    from miles.rollout.sampling import sample_on_engine",
        "from ...runtime.bringup import bring_up",
    ],
)
def test_the_check_catches_each_kind_of_forbidden_import(line: str) -> None:
    names = imported_modules(line, "miles.gateway.tinker.routes_sampling")
    assert violations(names), line


@pytest.mark.parametrize(
    "line",
    [
        "from miles.runtime.api import Runtime",
        "from miles.runtime import api",
        "from miles.state.records import ModelRecord",
        "from ..errors import bad_request",
    ],
)
def test_the_check_allows_the_runtime_api_and_the_gateway_s_own_neighbours(line: str) -> None:
    assert violations(imported_modules(line, "miles.gateway.tinker.routes_sampling")) == []
