"""Request bodies of the control endpoints (SGLang's msgspec structs, as pydantic models) and error bodies.

Like SGLang's adapter: the body is required, unknown keys are ignored, values are coerced laxly.
"""

from __future__ import annotations

import hashlib
from http import HTTPStatus
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class InitGroupReq(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupReq(BaseModel):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReq(BaseModel):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReq(BaseModel):
    pass


class UpdateFromDistributedReq(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    # "miles_delta": our delta push (docs/weights.md); SGLang would read it as one broadcast per tensor
    load_format: Literal["flattened_bucket", "miles_delta"] | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class CheckWeightsReq(BaseModel):
    """SGLang's CheckWeightsReqInput. Actions here: "checksum" (SGLang's own per-tensor hash on CPU: the
    first 8 bytes of sha256 of the tensor's bytes) and "miles_digest" (miles.utils.delta.digest, what a
    delta push is checked with); SGLang's snapshot/compare/reset_tensors are refused."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


class UpdateFromTensorReq(BaseModel):
    # one base64 ForkingPickler payload per TP rank (miles.utils.tensor_ipc); SGLang's field is
    # Annotated[List[bytes], Base64Bytes()], which its HTTP schema reads as base64 strings
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class ReleaseMemoryReq(BaseModel):
    tags: list[str] | None = None  # among kv_cache, weights, cuda_graph; None or [] = all


class ResumeMemoryReq(BaseModel):
    tags: list[str] | None = None


class UpdateWeightVersionReq(BaseModel):
    new_version: str
    abort_all_requests: bool = True


class PauseReq(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueReq(BaseModel):
    torch_empty_cache: bool = True


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class LoadLoraReq(BaseModel):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoraReq(BaseModel):
    lora_name: str
    lora_id: str | None = None


def openai_style_error(status: int, message: str, err_type: str | None = None) -> JSONResponse:
    """SGLang's envelope for validation errors and HTTPExceptions."""
    body = {
        "object": "error",
        "message": message,
        "type": err_type or HTTPStatus(status).phrase,
        "param": None,
        "code": status,
    }
    return JSONResponse(body, status_code=status)


def value_error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's `_create_error_response` for ValueErrors raised by native endpoints."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def checksum_body(checksums: dict[str, str]) -> dict[str, Any]:
    """`/weights_checker`'s answer beside success and message, in SGLang's shape: one rank (TP 1), its
    per-tensor checksums, their overall hash (sha256 over sorted names and checksums) and the engine's."""
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    per_gpu = overall.hexdigest()
    placement = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
    rank = {
        "checksums": checksums,
        "per_gpu_checksum": per_gpu,
        "parallelism_info": [{"role": "target", **placement}],
    }
    return {"ranks": [rank], "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()}


def success_body(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )
