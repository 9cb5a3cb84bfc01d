"""Every request body SGLangApiClient sends, checked against SGLang 0.5.23's own request types, and the CPU
engine's request models against the same types, field by field: a renamed field fails here.

- `/generate`: SGLang's own contract gate (`sglang.srt.entrypoints.api_contract`, the proto schema that
  answers 400 for an unknown sampling key) and the top-level fields of `sglang.api.v1.GenerateRequest`.
- Control endpoints: the body type each route of `sglang/srt/entrypoints/http_server.py` declares, read
  from SGLang's source, with its fields from `sglang/srt/managers/io_struct.py`. io_struct itself does not
  import without torchvision (no CPU build for torch 2.13 on PyPI), so its classes are read with `ast` and
  rebuilt as msgspec structs that validate through SGLang's own msgspec->pydantic adapter, as the server
  does (unknown keys ignored, lax coercion, required fields required).
- OpenAI routes of the CPU engine: against `sglang.srt.entrypoints.openai.protocol`.

Needs the `sglang` wheel (`make sglang-parser`); skipped without it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from pydantic import TypeAdapter

pytest.importorskip("sglang.srt.server_args", reason="sglang wheel not installed")

from sglang.api.v1.api_types import GenerateRequest
from sglang.api.v1.api_types import SamplingParams as ContractSamplingParams
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.entrypoints.openai import protocol as openai_protocol
from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema

from miles.engines import sglang_client
from miles.engines.cpu import openai_routes, protocol
from miles.engines.cpu.sampling import KNOWN_KEYS
from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.sampling import engine_sampling_params
from miles.types import SamplingParams

SGLANG_SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
NO_DEFAULT = object()
# The IPC-only fields every BaseReq carries; no HTTP client sets them.
IPC_FIELDS = {"http_worker_ipc"}
# Fields SGLang's scheduler fills on its own aborts (the struct doubles as its internal message); a client
# sending them is ignored by the CPU engine, as unknown keys are.
SCHEDULER_ONLY = {"/abort_request": {"finished_reason", "abort_message", "weight_versions"}}


@dataclass(frozen=True)
class FieldSpec:
    annotation: str
    default: Any  # NO_DEFAULT when required; a literal, else None for a computed default


@cache
def _classes(relative: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse((SGLANG_SRT / relative).read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def io_struct_fields(name: str) -> dict[str, FieldSpec]:
    """The annotated fields of an io_struct class, its io_struct bases' first (as msgspec orders them)."""
    classes = _classes("managers/io_struct.py")
    node = classes[name]
    fields: dict[str, FieldSpec] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(io_struct_fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            default: Any = NO_DEFAULT
            if stmt.value is not None:
                try:
                    default = ast.literal_eval(stmt.value)
                except ValueError:
                    default = None
            fields[stmt.target.id] = FieldSpec(ast.unparse(stmt.annotation), default)
    return fields


@cache
def route_body_types() -> dict[str, str]:
    """Path -> the io_struct class its handler in http_server.py takes as `obj`."""
    tree = ast.parse((SGLANG_SRT / "entrypoints/http_server.py").read_text())
    routes = {}
    for node in tree.body:
        if not isinstance(node, ast.AsyncFunctionDef) or not node.args.args:
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
            if isinstance(d.func, ast.Attribute) and d.func.attr in ("post", "api_route", "put")
        ]
        obj = next((a for a in node.args.args if a.arg == "obj" and a.annotation is not None), None)
        if obj is None:
            continue
        names = [n.id for n in ast.walk(obj.annotation) if isinstance(n, ast.Name) and n.id[0].isupper()]
        body_type = next(n for n in names if n not in ("Annotated", "Body", "Optional", "Union"))
        routes.update({path: body_type for path in paths})
    return routes


def _python_type(annotation: str) -> Any:
    namespace = {
        name: getattr(typing, name)
        for name in ("List", "Dict", "Optional", "Union", "Literal", "Any", "Annotated")
    }
    builtins = {t.__name__: t for t in (list, dict, str, int, float, bool, bytes)}
    try:
        # Base64Bytes: SGLang's own marker, so base64 fields (serialized_named_tensors) are decoded as the
        # server decodes them
        return eval(annotation, {**namespace, **builtins, "Base64Bytes": Base64Bytes})
    except NameError:  # an io_struct type of its own (tensors, spans): not something we send
        return Any


@cache
def sglang_body_type(class_name: str) -> TypeAdapter:
    """The io_struct class rebuilt as a msgspec struct validated by SGLang's own pydantic adapter."""
    spec = []
    for field, info in io_struct_fields(class_name).items():
        kind = _python_type(info.annotation)
        spec.append((field, kind) if info.default is NO_DEFAULT else (field, kind, info.default))
    struct = msgspec.defstruct(
        class_name,
        spec,
        kw_only=True,
        namespace={
            "__get_pydantic_core_schema__": classmethod(
                lambda cls, source, handler: msgspec_struct_pydantic_core_schema(cls, handler)
            )
        },
    )
    return TypeAdapter(struct)


# ----- what the client sends ---------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[tuple[str, Any]] = []
        self.queries: dict[str, dict[str, str]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.params:
            self.queries[request.url.path] = dict(request.url.params)
        if not request.content:
            return httpx.Response(200, text="Cache flushed.")
        body = json.loads(request.content)
        self.bodies.append((request.url.path, body))
        if request.url.path == "/generate" and body.get("stream"):
            return httpx.Response(200, text='data: {"output_ids": [], "meta_info": {}}\n\ndata: [DONE]\n\n')
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {}})
        return httpx.Response(200, json={"success": True, "message": "ok"})


async def client_bodies(
    monkeypatch: pytest.MonkeyPatch, recorder: Recorder | None = None
) -> list[tuple[str, Any]]:
    """One call of every SGLangApiClient method, with the arguments the runtime passes."""
    recorder = recorder or Recorder()
    http = httpx.AsyncClient(transport=httpx.MockTransport(recorder))
    monkeypatch.setattr(sglang_client, "get_async_client", lambda purpose: http)
    client = SGLangApiClient("http://engine:30000", api_key="k")
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_strings=("\n",), seed=3)
    await client.generate(
        input_ids=[1, 2, 3],
        sampling_params=engine_sampling_params(params, seed=3),
        return_logprob=True,
        lora_path="snap-0123456789abcdef",
        rid="r-1",
        logprob_start_len=0,
    )
    no_stop = SamplingParams(max_tokens=4, stop_strings=(), stop_token_ids=())
    await client.generate(input_ids=[5], sampling_params=engine_sampling_params(no_stop, seed=None))
    await client.generate(  # Tinker's top-k and target prompt logprobs
        input_ids=[1, 2, 3],
        sampling_params=engine_sampling_params(params, seed=None),
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=5,
        token_ids_logprob=[4, 9],
    )
    await client.generate(  # prompt_alt_tokens_k: one-token draws, a batch of prefixes
        input_ids=[[1], [1, 2]],
        sampling_params=[{"max_new_tokens": 1, "temperature": 0.7, "sampling_seed": s} for s in (0, 1)],
        return_logprob=True,
        lora_path="snap-0123456789abcdef",
    )
    async for _ in client.generate_stream(
        input_ids=[1, 2, 3], sampling_params=engine_sampling_params(params, seed=3), return_logprob=True
    ):
        pass
    await client.abort_request("r-1")
    await client.abort_request(abort_all=True)
    for mode in ("abort", "retract", "in_place"):
        await client.pause_generation(mode)
    await client.continue_generation()
    await client.flush_cache(timeout_s=1.5)
    await client.init_weights_update_group(
        master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3, backend="gloo"
    )
    await client.begin_weight_update()
    await client.update_weights_from_distributed(
        names=["w", "b"], dtypes=["bfloat16", "float32"], shapes=[[2, 2], [2]], load_format="flattened_bucket"
    )
    await client.update_weights_from_distributed(
        names=["w"], dtypes=["float32"], shapes=[[4]], flush_cache=True, weight_version="v2"
    )
    await client.update_weights_from_tensor(["cGF5bG9hZA=="], weight_version="v3")
    await client.update_weights_from_tensor(["cGF5bG9hZA=="], load_format="direct", flush_cache=False)
    await client.update_weight_version("v2", abort_all_requests=False)
    await client.end_weight_update()
    await client.release_memory_occupation(["weights", "kv_cache"])
    await client.resume_memory_occupation(None)
    await client.destroy_weights_update_group()
    await client.load_lora_adapter("snap-0123456789abcdef", "/ckpt/adapter")
    await client.unload_lora_adapter("snap-0123456789abcdef")
    await http.aclose()
    return recorder.bodies


async def test_generate_bodies_pass_sglangs_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    generate = [body for path, body in await client_bodies(monkeypatch) if path == "/generate"]
    assert len(generate) == 5
    top_level = set(GenerateRequest.__struct_fields__)
    for body in generate:
        assert generate_contract_error(body) is None, body
        # unknown top-level keys are silently ignored by SGLang: a renamed one must fail here
        assert set(body) <= top_level, set(body) - top_level
    assert set(generate[0]) == {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "lora_path",
        "rid",
        "logprob_start_len",
    }
    assert {"top_logprobs_num", "token_ids_logprob"} <= set(generate[2])
    assert generate[4]["stream"] is True


async def test_control_bodies_validate_as_the_routes_declared_types(monkeypatch: pytest.MonkeyPatch) -> None:
    routes = route_body_types()
    checked = set()
    for path, body in await client_bodies(monkeypatch):
        if path == "/generate":
            continue
        assert path in routes, f"SGLang has no {path} route taking a body"
        fields = io_struct_fields(routes[path])
        assert set(body) <= set(fields) - IPC_FIELDS, (path, set(body) - set(fields))
        sglang_body_type(routes[path]).validate_python(body)  # required fields, types (lax, as the server)
        checked.add(path)
    assert len(checked) == 14


async def test_flush_cache_sends_the_query_parameter_sglang_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    await client_bodies(monkeypatch, recorder)
    tree = ast.parse((SGLANG_SRT / "entrypoints/http_server.py").read_text())
    handler = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "flush_cache")
    assert set(recorder.queries["/flush_cache"]) == {a.arg for a in handler.args.args} == {"timeout"}
    assert float(recorder.queries["/flush_cache"]["timeout"]) == 1.5


# ----- the CPU engine accepts what SGLang accepts --------------------------------------------------------

CPU_MODELS = {
    "/init_weights_update_group": protocol.InitGroupReq,
    "/destroy_weights_update_group": protocol.DestroyGroupReq,
    "/begin_weight_update": protocol.BeginWeightUpdateReq,
    "/end_weight_update": protocol.EndWeightUpdateReq,
    "/update_weights_from_distributed": protocol.UpdateFromDistributedReq,
    "/update_weights_from_tensor": protocol.UpdateFromTensorReq,
    "/release_memory_occupation": protocol.ReleaseMemoryReq,
    "/resume_memory_occupation": protocol.ResumeMemoryReq,
    "/update_weight_version": protocol.UpdateWeightVersionReq,
    "/pause_generation": protocol.PauseReq,
    "/continue_generation": protocol.ContinueReq,
    "/abort_request": protocol.AbortReq,
    "/load_lora_adapter": protocol.LoadLoraReq,
    "/unload_lora_adapter": protocol.UnloadLoraReq,
}


@pytest.mark.parametrize("path", sorted(CPU_MODELS))
def test_cpu_engine_control_models_match_sglang_field_by_field(path: str) -> None:
    skipped = IPC_FIELDS | SCHEDULER_ONLY.get(path, set())
    theirs = {k: v for k, v in io_struct_fields(route_body_types()[path]).items() if k not in skipped}
    ours = CPU_MODELS[path].model_fields
    theirs_without_rid = {k: v for k, v in theirs.items() if k != "rid" or "rid" in ours}
    assert set(ours) == set(theirs_without_rid), set(ours) ^ set(theirs_without_rid)
    for name, field in ours.items():
        expected = theirs[name].default
        if expected is NO_DEFAULT:
            assert field.is_required(), name
        elif name != "rid":  # AbortReq's __post_init__ turns SGLang's None into "", our default
            assert field.get_default() == expected, (name, field.get_default(), expected)


def test_cpu_engine_sampling_keys_are_sglangs() -> None:
    assert set(KNOWN_KEYS) == set(ContractSamplingParams.__struct_fields__)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (openai_routes.CompletionRequest, openai_protocol.CompletionRequest),
        (openai_routes.ChatCompletionRequest, openai_protocol.ChatCompletionRequest),
    ],
)
def test_cpu_engine_openai_models_are_a_subset_of_sglangs(ours: Any, theirs: Any) -> None:
    for name, field in ours.model_fields.items():
        assert name in theirs.model_fields, f"SGLang's {theirs.__name__} has no {name!r}"
        other = theirs.model_fields[name]
        assert field.is_required() == other.is_required(), name
        assert field.get_default(call_default_factory=True) == other.get_default(call_default_factory=True), (
            name
        )
