"""Data types shared by the gateway, the trainers and the engines.

These are the runtime's own shapes, independent of the wire: the gateway decodes Tinker's protobuf/JSON
into them, trainers and the sampler consume them. Arrays are numpy so they pickle cheaply through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np


@dataclass
class Datum:
    """One training example: `model_input[i]` predicts `loss_fn_inputs["target_tokens"][i]`."""

    model_input: np.ndarray  # int64 [N], chunks already concatenated
    loss_fn_inputs: dict[str, np.ndarray]  # e.g. target_tokens int64 [N], weights float32 [N]


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    alpha: float | None = None  # None: the backend default (documented in miles/train)
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs, in the batch's order, plus metrics keyed `name:reduction`."""

    logprobs: list[np.ndarray]  # float32 [N_i] per datum: log p(target_tokens[i] | prefix)
    elementwise_loss: list[np.ndarray]  # float32 [N_i] per datum
    metrics: dict[str, float] = field(default_factory=dict)  # must contain "loss:sum"
    # how long the backend computed it, on the rank (ForwardBackward sets it): the gateway's stage timings
    compute_ns: int = field(default=0, compare=False)
    # every data-parallel rank's compute_ns, rank order (the trainer cell fills it): the session trace
    rank_compute_ns: tuple[int, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all
    seed: int | None = None
    # None = stop at EOS; [] = never stop early; strings or token ids otherwise
    stop_strings: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class LogprobSpec:
    """What a sample reports beyond the sampled tokens' own logprobs (Tinker's SampleRequest fields)."""

    prompt: bool = False  # each prompt token's logprob
    prompt_last_n: int | None = None  # score only the last n prompt tokens (prompt and topk_prompt)
    topk_prompt: int = 0  # the k most likely tokens at each prompt position
    topk_sample: int = 0  # the k most likely tokens at each sampled position
    target_prompt: np.ndarray | None = None  # int64 [len(prompt) - 1, K]: ids to score, -1 = none
    alt_tokens_k: int = 0  # k draws at each prompt position after the first

    def prompt_side(self) -> bool:
        return self.prompt or self.topk_prompt > 0 or self.target_prompt is not None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # the sampled tokens' logprobs (never the top-1's)
    stop_reason: Literal["stop", "length"]
    topk: list[TopLogprobs | None] | None = None  # per sampled token, when topk_sample > 0
    # Which weight version sampled which tokens: [{"version", "start", "end"}, ...] over `tokens`, as the
    # engine reports it (SGLang's meta_info weight_versions); more than one span only when the weights
    # were updated in place while this sequence ran (runtime.push_update in_place).
    weight_versions: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class SampleChunk:
    """New tokens of sequence `index` of a streamed sample; its last chunk carries the stop reason."""

    index: int
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"] | None = None


@dataclass(frozen=True)
class TimedPart:
    """Work done below the gateway for one operation (a push's buckets, an engine's generation), for the
    session trace: on the operation's track plus `lane` (e.g. "push", "engine"), at wall-clock `start_s`."""

    name: str
    lane: str
    start_s: float
    duration_s: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # [None, lp(t1|t0), ...] when requested
    topk_prompt: list[TopLogprobs | None] | None = None  # per prompt position, None where not scored
    target_prompt: np.ndarray | None = None  # float32, the shape of LogprobSpec.target_prompt
    alt_tokens: np.ndarray | None = None  # int64 [len(prompt) - 1, k]
    alt_logprobs: np.ndarray | None = None  # float32 [len(prompt) - 1, k]
    timeline: list[TimedPart] = field(default_factory=list)  # the engine's side of it (session traces)
