"""Routes (method + path) of SGLangApiClient and of the CPU engine against SGLang 0.5.23's own route table,
read from its `http_server.py` by tools/sglang_contract.py, and the committed snapshot of that contract
(sglang_contract.json: `make sglang-contract SGLANG_VERSION=x.y.z` checks a newer SGLang against it).

What the client sends is recorded (sglang_usage.py: every client method called through a mock transport),
what the engine serves is read from its FastAPI app: no hand-kept list of either. The tests against
SGLang's source need the wheel (`make sglang-parser`) and skip without it; those of the parser and the
comparison run on plain data and a source tree written here.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import textwrap
from functools import cache
from pathlib import Path

import pytest

from tests.fast.engines.sglang_usage import (
    Recorder,
    client_methods,
    client_usage,
    cpu_engine_routes,
    exercise_client,
)
from tools import sglang_contract as sc

SNAPSHOT = Path(__file__).with_name("sglang_contract.json")
needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="sglang wheel not installed (make sglang-parser)"
)
# Routes the CPU engine serves that SGLang does not have, each with the reason. None today: the engine
# is a stand-in for SGLang, so a route of its own would be one the runtime could come to rely on and
# then miss on a GPU node.
CPU_ENGINE_ONLY: dict[str, str] = {}


@cache
def sglang_table() -> dict[str, set[str]]:
    return sc.route_table(sc.sglang_routes(sc.installed_root()))


@cache
def usage(weight_api: str = "current") -> dict[str, dict[str, list[str]]]:
    return client_usage(weight_api)  # type: ignore[arg-type]


# ----- our side, recorded ------------------------------------------------------------------------------


async def test_every_client_method_is_exercised() -> None:
    """A client method the recorder does not call would send a route no test checks."""
    recorder = Recorder()
    await exercise_client(recorder)
    assert client_methods() - recorder.called == set()
    sent = {f"{r.method} {r.path}" for r in recorder.requests}
    assert {"GET /health", "GET /model_info", "POST /flush_cache", "POST /generate"} <= sent


@pytest.mark.parametrize("weight_api", ["current", "legacy"])
def test_the_cpu_engine_serves_every_route_the_client_sends(weight_api: str) -> None:
    engine = sc.table_of(cpu_engine_routes(legacy_weight_api=weight_api == "legacy"))
    assert sc.missing_routes(usage(weight_api), engine, "the client", "the CPU engine") == []


# ----- against SGLang's route table --------------------------------------------------------------------


@needs_sglang
def test_every_route_the_client_sends_is_sglangs() -> None:
    assert sc.missing_routes(usage(), sglang_table(), "the client") == []


@needs_sglang
@pytest.mark.parametrize("legacy", [False, True])
def test_every_route_of_the_cpu_engine_is_sglangs(legacy: bool) -> None:
    served = cpu_engine_routes(legacy_weight_api=legacy)
    assert set(CPU_ENGINE_ONLY) <= served, "an allow-listed route the engine no longer serves"
    assert sc.missing_routes(served - set(CPU_ENGINE_ONLY), sglang_table(), "the CPU engine") == []
    # an allow-listed route that SGLang has gained needs no exception any more
    assert sc.missing_routes(CPU_ENGINE_ONLY, sglang_table(), "the CPU engine") == [
        f"{key}: the CPU engine uses it, SGLang has no {key.split(' ', 1)[1]} route"
        for key in sorted(CPU_ENGINE_ONLY)
    ]


@needs_sglang
def test_the_snapshot_is_the_contract_of_the_installed_sglang() -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    root = sc.installed_root()
    if sc.sglang_version(root) != snapshot["sglang_version"]:
        pytest.skip(f"snapshot of SGLang {snapshot['sglang_version']}, installed {sc.sglang_version(root)}")
    computed = sc.build_contract(root, usage(), cpu_engine_routes())
    if computed != snapshot:
        diff = difflib.unified_diff(
            json.dumps(snapshot, indent=1).splitlines(),
            json.dumps(computed, indent=1).splitlines(),
            "committed",
            "computed",
            lineterm="",
        )
        pytest.fail(
            "sglang_contract.json is stale; review and regenerate it with "
            "`make sglang-contract SGLANG_CONTRACT_ARGS=--write`:\n" + "\n".join(diff)
        )


# ----- the comparison, on plain data -------------------------------------------------------------------


def test_a_missing_route_or_method_is_named() -> None:
    table = {"/generate": {"POST", "PUT"}, "/flush_cache": {"POST"}}
    problems = sc.missing_routes(
        ["POST /generate", "GET /flush_cache", "POST /abort_request"], table, "the client"
    )
    assert problems == [
        "GET /flush_cache: the client uses GET, SGLang's /flush_cache answers only POST",
        "POST /abort_request: the client uses it, SGLang has no /abort_request route",
    ]


def _snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text())


def test_the_committed_snapshot_compares_equal_to_itself() -> None:
    assert sc.compare(_snapshot(), _snapshot()) == ([], [])


def test_compare_reports_what_breaks_the_client() -> None:
    old, new = _snapshot(), _snapshot()
    new["sglang_routes"].remove("POST /abort_request")
    new["sglang_routes"].remove("GET /flush_cache")  # a method gone: only the CPU engine serves GET
    new["sglang_routes"].append("GET /brand_new")
    fields = new["sglang_bodies"]["POST /update_weight_version"]["fields"]
    del fields["new_version"]  # a field the client sends
    fields["must_have"] = {"type": "int", "required": True}  # a required field it does not send
    new["sglang_handler_params"]["POST /flush_cache"] = ["timeout_s"]
    changes, breaks = sc.compare(old, new)
    assert "route added: GET /brand_new" in changes
    assert "route removed: POST /abort_request" in changes
    assert "methods of /flush_cache: GET POST -> POST" in changes
    assert breaks == [
        "POST /abort_request: the client uses it, SGLang has no /abort_request route",
        "GET /flush_cache: the CPU engine uses GET, SGLang's /flush_cache answers only POST",
        "POST /abort_request: the CPU engine uses it, SGLang has no /abort_request route",
        "POST /flush_cache: the client sends ?timeout=, SGLang's handler has no such parameter",
        "POST /update_weight_version: the client sends new_version, "
        "SGLang's UpdateWeightVersionReqInput has no such field",
        "POST /update_weight_version: must_have is required by SGLang, the client does not send it",
    ]


def test_compare_reports_harmless_changes_without_breaking() -> None:
    old, new = _snapshot(), _snapshot()
    fields = new["sglang_bodies"]["POST /pause_generation"]["fields"]
    fields["new_option"] = {"type": "bool", "required": False}
    del fields["http_worker_ipc"]  # a field the client does not send
    changes, breaks = sc.compare(old, new)
    assert changes == [
        "POST /pause_generation: field added new_option (bool)",
        "POST /pause_generation: field removed http_worker_ipc",
    ]
    assert breaks == []


# ----- the parser, on a source tree written here -------------------------------------------------------

HTTP_SERVER = """
import os
from fastapi import APIRouter, FastAPI
from sglang.srt.entrypoints.extra import router as extra_router
from sglang.srt.managers.io_struct import PingReq
from . import sibling

app = FastAPI()
local = APIRouter(prefix="/local")
ROOT = os.environ.get("ROOT_ROUTE")

@app.get("/health")
@app.get("/health_generate")
async def health(): ...

@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(timeout: float = 0.0): ...

@app.api_route("/plain")
async def plain(): ...

@app.post(os.environ.get("PREDICT_ROUTE", "/predict"))
async def predict(obj: PingReq, request: Request): ...

if os.environ.get("DEBUG"):
    @app.post("/debug")
    async def debug(): ...
else:
    @app.head("/")
    async def root(): ...

@local.delete("/item")
async def delete_item(): ...

async def added(obj: Annotated[PingReq, Body()]): ...

app.add_api_route("/added", added, methods=["PUT"])
app.add_api_route(path="/kw", endpoint=health)
app.include_router(extra_router, prefix="/x")
app.include_router(router=sibling.router)
app.include_router(local)
"""
EXTRA = """
from fastapi import APIRouter
router = APIRouter(prefix="/extra")

@router.get("/loads")
async def loads(): ...
"""
SIBLING = """
from fastapi import APIRouter
router = APIRouter()

@router.websocket("/ws")
async def ws(): ...
"""
IO_STRUCT = """
from dataclasses import field
class BaseReq:
    rid: Optional[str] = None
class PingReq(BaseReq):
    name: str
    count: int = 3
    tags: List[str] = field(default_factory=list)
    token: str = field(kw_only=True)
"""


def _write_tree(root: Path) -> Path:
    package = root / "sglang"
    files = {
        "srt/entrypoints/http_server.py": HTTP_SERVER,
        "srt/entrypoints/extra.py": EXTRA,
        "srt/entrypoints/sibling.py": SIBLING,
        "srt/managers/io_struct.py": IO_STRUCT,
        "_version.py": "__version__ = version = '9.9.9'\n",
    }
    for relative, text in files.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(textwrap.dedent(text))
    return package


def test_the_parser_reads_every_way_of_registering_a_route(tmp_path: Path) -> None:
    root = _write_tree(tmp_path)
    routes = {r.key: r for r in sc.sglang_routes(root)}
    assert set(routes) == {
        "GET /health",
        "GET /health_generate",
        "GET /flush_cache",
        "POST /flush_cache",
        "GET /plain",  # api_route without methods: FastAPI's GET
        "POST /predict",
        "POST /debug",
        "HEAD /",
        "DELETE /local/item",  # a router of this module, its prefix applied
        "PUT /added",
        "GET /kw",  # add_api_route by keyword, without methods: GET
        "GET /x/extra/loads",  # imported from another module: include prefix + router prefix
        "WEBSOCKET /ws",  # `module.router` of a relative import, passed by keyword
    }
    assert routes["POST /predict"].note == "path read from $PREDICT_ROUTE, this is its default"
    assert routes["POST /debug"].note == "os.environ.get('DEBUG')"
    assert routes["HEAD /"].note == "not (os.environ.get('DEBUG'))"
    assert routes["POST /flush_cache"].params == ("timeout",)
    assert routes["POST /predict"].body_type == routes["PUT /added"].body_type == "PingReq"
    assert sc.sglang_version(root) == "9.9.9"


def test_the_parser_reads_io_struct_fields_and_what_is_required(tmp_path: Path) -> None:
    root = _write_tree(tmp_path)
    fields = sc.io_struct_fields(root, "PingReq")
    assert list(fields) == ["rid", "name", "count", "tags", "token"]  # the base's first
    required = {name for name, spec in fields.items() if spec.default is sc.NO_DEFAULT}
    assert required == {"name", "token"}  # field(kw_only=True) without a default is required
    assert fields["count"].default == 3


def test_the_command_line_compares_a_source_tree_with_a_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write_tree(tmp_path / "v1")
    client = {
        "GET /health": {},
        "POST /predict": {"body": ["name", "token"]},
        "POST /flush_cache": {"query": ["timeout"]},
    }
    snapshot = tmp_path / "contract.json"
    sc.write(snapshot, sc.build_contract(root, client, ["GET /health", "GET /plain"]))
    assert sc.main(["--sglang-root", str(root), "--compare", str(snapshot)]) == 0
    assert "no change" in capsys.readouterr().out

    newer = _write_tree(tmp_path / "v2")
    server = newer / "srt/entrypoints/http_server.py"
    server.write_text(server.read_text().replace('@app.api_route("/plain")', '@app.post("/plain")'))
    assert sc.main(["--sglang-root", str(newer), "--compare", str(snapshot)]) == 1
    out = capsys.readouterr().out
    assert "methods of /plain: GET -> POST" in out
    assert "GET /plain: the CPU engine uses GET, SGLang's /plain answers only POST" in out
