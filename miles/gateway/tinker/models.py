"""Request bodies of the Tinker JSON endpoints (lenient: unknown fields are ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from miles.contract.custom_loss import MAX_INPUTS
from miles.gateway.bounds import INT64_MAX, Int64
from miles.gateway.tinker.ids import ModelId, RequestId, SamplerId, SessionId


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(_Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None


class SessionBody(_Body):
    session_id: SessionId


class FinishReason(_Body):
    type: str = "success"


class FinishBody(_Body):
    reason: FinishReason | None = None
    detail: str | None = None


class RetrieveFutureBody(_Body):
    request_id: RequestId
    allow_metadata_only: bool = False


class LoraConfigBody(_Body):
    # 0: full fine-tuning (the SDK has no full-model creator; docs/gateway.md)
    rank: int = Field(ge=0, le=INT64_MAX)
    seed: Int64 | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(_Body):
    session_id: SessionId
    model_seq_id: int = Field(ge=0, le=INT64_MAX)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None


class ModelBody(_Body):
    model_id: ModelId


class AdamParamsBody(_Body):
    type: str | None = None
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(_Body):
    model_id: ModelId
    seq_id: Int64 | None = None
    # the SDK sends adam_params for Adam and optimizer_params for any other optimizer (e.g. dimuon)
    adam_params: AdamParamsBody | None = Field(
        None, validation_alias=AliasChoices("adam_params", "optim_params")
    )
    optimizer_params: dict[str, Any] | None = None


# a checkpoint's user_metadata (save_state, save_weights_for_sampler): search_checkpoints matches on it
CheckpointMetadata = Annotated[
    dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]],
    Field(max_length=64),
]


class SaveWeightsBody(_Body):
    model_id: ModelId
    path: str | None = None
    seq_id: Int64 | None = None
    overwrite: bool = False
    ttl_seconds: Int64 | None = None
    user_metadata: CheckpointMetadata | None = None


class SaveWeightsExternalBody(_Body):
    model_id: ModelId
    path: str  # the export's name: tinker://{model_id}/external_weights/{path}
    seq_id: Int64 | None = None
    ttl_seconds: Int64 | None = None
    age_encryption_recipients: list[str] | None = None


class CheckpointTtlBody(_Body):
    ttl_seconds: Int64 | None = None  # None: keep the checkpoint forever


class SaveForSamplerBody(_Body):
    model_id: ModelId
    path: str | None = None
    sampling_session_seq_id: Int64 | None = None
    seq_id: Int64 | None = None
    kind: str = "snapshot"
    ttl_seconds: Int64 | None = None
    user_metadata: CheckpointMetadata | None = None


class LoadWeightsBody(_Body):
    model_id: ModelId | None = None
    seq_id: Int64 | None = None
    session_id: SessionId | None = None
    model_seq_id: Int64 | None = None
    path: str
    optimizer: bool = False


class CreateSamplingSessionBody(_Body):
    session_id: SessionId
    sampling_session_seq_id: int = Field(ge=0, le=INT64_MAX)
    base_model: str | None = None
    model_path: str | None = None


class ChunkBody(_Body):
    type: str = "encoded_text"
    tokens: list[Int64] | None = None


class PromptBody(_Body):
    chunks: list[ChunkBody]


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    seed: Int64 | None = None
    stop: str | list[str] | list[Int64] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: Int64 = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleBody(_Body):
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: PromptBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: SamplerId | None = None
    seq_id: Int64 | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Int64 = 0
    topk_sample_logprobs: Int64 = 0
    prompt_alt_tokens_k: Int64 = 0
    prompt_logprobs_last_n: Int64 | None = None
    target_prompt_logprobs: dict[str, Any] | None = None
    type: Literal["sample"] = "sample"


class WeightsInfoBody(_Body):
    tinker_path: str


class CreateCustomLossBody(_Body):
    """tinker's CreateCustomLossRequest; the graph is checked by miles.contract.custom_loss."""

    session_id: SessionId
    custom_loss_seq_id: int = Field(ge=0, le=INT64_MAX)
    name: str = Field(min_length=1, max_length=128)
    inputs: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_INPUTS)
    graph: dict[str, Any]


class CopyWeightsBody(_Body):
    """tinker's CopyWeightsRequest."""

    source_path: str = Field(min_length=1, max_length=4096)
    session_id: SessionId | None = None
    model_seq_id: int | None = Field(None, ge=0, le=INT64_MAX)
    destination_project_id: str | None = Field(None, max_length=256)
    ttl_seconds: int | None = None


class ExternalWeightsUploadStartBody(_Body):
    """tinker 0.39's ExternalWeightsUploadStartRequest."""

    base_model: str = Field(min_length=1, max_length=256)
    lora_config: LoraConfigBody
    destination_project_id: str | None = Field(None, max_length=256)


class ExternalWeightsUploadFinishBody(_Body):
    upload_id: str = Field(min_length=1, max_length=64)
