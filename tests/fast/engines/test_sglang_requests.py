"""Every request body SGLangApiClient sends, checked against SGLang 0.5.23's own request types, and the CPU
engine's request models against the same types, field by field: a renamed field fails here.

- `/generate`: SGLang's own contract gate (`sglang.srt.entrypoints.api_contract`, the proto schema that
  answers 400 for an unknown sampling key) and the top-level fields of `sglang.api.v1.GenerateRequest`.
- Control endpoints: the body type each route of `sglang/srt/entrypoints/http_server.py` declares, read
  from SGLang's source, with its fields from `sglang/srt/managers/io_struct.py` (both read by
  tools/sglang_contract.py; the requests are recorded by sglang_usage.py). io_struct itself does not
  import without torchvision (no CPU build for torch 2.13 on PyPI), so its classes are read with `ast` and
  rebuilt as msgspec structs that validate through SGLang's own msgspec->pydantic adapter, as the server
  does (unknown keys ignored, lax coercion, required fields required).
- OpenAI routes of the CPU engine: against `sglang.srt.entrypoints.openai.protocol`.

Needs the `sglang` wheel (`make sglang-parser`); skipped without it.
"""

from __future__ import annotations

import ast
import importlib.util
import typing
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pydantic import TypeAdapter

pytest.importorskip("sglang.srt.server_args", reason="sglang wheel not installed")

from sglang.api.v1.api_types import GenerateRequest
from sglang.api.v1.api_types import SamplingParams as ContractSamplingParams
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.entrypoints.openai import protocol as openai_protocol
from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema

from miles.engines.cpu import openai_routes, protocol
from miles.engines.cpu.sampling import KNOWN_KEYS
from tests.fast.engines.sglang_usage import Recorder, exercise_client
from tools import sglang_contract
from tools.sglang_contract import NO_DEFAULT, FieldSpec

SGLANG_ROOT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
SGLANG_SRT = SGLANG_ROOT / "srt"
# The IPC-only fields every BaseReq carries; no HTTP client sets them.
IPC_FIELDS = {"http_worker_ipc"}
# Fields SGLang's scheduler fills on its own aborts (the struct doubles as its internal message); a client
# sending them is ignored by the CPU engine, as unknown keys are.
SCHEDULER_ONLY = {"/abort_request": {"finished_reason", "abort_message", "weight_versions"}}


def io_struct_fields(name: str) -> dict[str, FieldSpec]:
    """The annotated fields of an io_struct class (read from the installed wheel's source)."""
    return sglang_contract.io_struct_fields(SGLANG_ROOT, name)


@cache
def route_body_types() -> dict[str, str]:
    """Path -> the io_struct class its handler in http_server.py takes as `obj`."""
    return sglang_contract.route_body_types(SGLANG_ROOT)


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


async def client_bodies(recorder: Recorder | None = None) -> list[tuple[str, Any]]:
    """(path, body) of every request with a body that SGLangApiClient's methods send."""
    recorder = recorder or Recorder()
    await exercise_client(recorder)
    return recorder.bodies


async def test_generate_bodies_pass_sglangs_contract() -> None:
    generate = [body for path, body in await client_bodies() if path == "/generate"]
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


async def test_control_bodies_validate_as_the_routes_declared_types() -> None:
    routes = route_body_types()
    checked = set()
    for path, body in await client_bodies():
        if path == "/generate":
            continue
        assert path in routes, f"SGLang has no {path} route taking a body"
        fields = io_struct_fields(routes[path])
        assert set(body) <= set(fields) - IPC_FIELDS, (path, set(body) - set(fields))
        sglang_body_type(routes[path]).validate_python(body)  # required fields, types (lax, as the server)
        checked.add(path)
    assert len(checked) == 15


async def test_flush_cache_sends_the_query_parameter_sglang_reads() -> None:
    recorder = Recorder()
    await client_bodies(recorder)
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
