"""`model:`: the base model, its training mode and backend, and megatron's parallel sizes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.contract.preset.base import StrictModel

Recompute = Literal["none", "selective", "full"]
# The architectures the driver can build for `init: tiny` (miles.models.tiny.TINY_SHAPES has one spec each)
InitShape = Literal["tiny", "qwen3-0.6b"]


# The preset's `model.parallel` and the megatron backend's layout are this one class: the backend gets it as
# a dict over the trainer's command path and checks it with miles.contract.layout, as the preset does.
class ParallelLayout(StrictModel):
    """How the megatron backend spreads the model over the trainer GPUs (model.backend: megatron)."""

    tensor: int = Field(1, ge=1, description="Tensor-parallel size (divides heads, KV heads, MLP, vocab).")
    pipeline: int = Field(1, ge=1, description="Pipeline stages (divides the layers).")
    context: int = Field(
        1,
        ge=1,
        description="Context-parallel size: each sequence cut over this many GPUs (full fine-tuning and "
        "LoRA; max_context a multiple of 2 x context).",
    )
    data: int | None = Field(
        None, ge=1, description="Data-parallel size; none = trainer GPUs / (tensor x pipeline x context)."
    )
    sequence_parallel: bool = Field(False, description="Split norms and dropout over TP ranks (tensor > 1).")
    recompute: Recompute = Field(
        "none", description="Activation recomputation: none, selective (attention core) or full (each layer)."
    )

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_size(self, trainer_gpus: int) -> int:
        return self.data if self.data is not None else trainer_gpus // self.model_parallel


class ModelOptions(StrictModel):
    name: str = Field(description="Base model name clients use (tinker `base_model`).")
    path: str | None = Field(
        None, description="Hugging Face directory or hub name; required unless init is tiny."
    )
    init: Literal["pretrained", "tiny"] = Field(
        "pretrained", description="`tiny`: the driver builds the tiny test model into the run dir."
    )
    init_shape: InitShape = Field(
        "tiny",
        description="With init tiny, the architecture the driver builds (random weights, small tokenizer): "
        "`tiny` (under a million parameters, float32) or `qwen3-0.6b` (Qwen3-0.6B's exact shape in "
        "bfloat16: real memory use and step times without a download). Init pretrained refuses it.",
    )
    backend: Literal["transformers", "megatron"] = Field("transformers", description="Training backend.")
    train_mode: Literal["lora", "full"] = Field("lora", description="LoRA adapters or full fine-tuning.")
    lora_rank: int = Field(32, ge=1, description="LoRA rank (train_mode lora).")
    max_context: int = Field(4096, ge=16, description="Maximum sequence length in tokens.")
    parallel: ParallelLayout = Field(
        default_factory=ParallelLayout, description="Megatron parallel sizes (model.backend: megatron)."
    )
