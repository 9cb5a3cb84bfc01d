"""`runtime:` (the driver's settings: state, checkpoints, the weight push), `elastic:`, and the driver's
and services' command lines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from miles.contract.preset.base import SAFE_NAME, StrictModel


class CommandOptions(StrictModel):
    command: list[str] | None = Field(None, description="argv list; none = the default.")


class RuntimeOptions(StrictModel):
    """What the driver (`miles.driver.serve`) needs beyond the roles: state, checkpoints, the weight push."""

    state_url: str | None = Field(
        None, description="`redis://host:port/db` to keep gateway state across restarts; none = memory."
    )
    state_key_prefix: str | None = Field(
        None,
        description="Key prefix of this deployment's state in `state_url` (and of its catalog's Ray "
        "namespace); none = `miles-<preset name>`. Give two jobs of one preset sharing a Redis different "
        "prefixes: a job recovers (and takes over) whatever state its prefix holds.",
    )
    checkpoint_root: str | None = Field(
        None, description="Shared directory for checkpoints; none = `<run_dir>/checkpoints`."
    )
    trainer_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Trainer parameter dtype (bfloat16 on GPUs)."
    )
    push_bucket_mb: float = Field(512, gt=0, description="Weight-push bucket size in MiB.")
    push_bucket_gap_s: float = Field(
        0.0, ge=0, description="TEST HOOK: idle seconds between weight-push buckets (keep-alive drills)."
    )
    push_delta: bool = Field(
        False,
        description="Send each full-weight push after the first as what changed since the last one over "
        "the same engines, checked per tensor by digest (a mismatch pushes again in full): docs/weights.md "
        '"Delta push". Needs the CPU engine (SGLang 0.5.23 takes no custom format on '
        "update_weights_from_distributed), full fine-tuning and split roles. The trainer keeps one more "
        "copy of the weights as sent. After two delta pushes in a row slower than the last full one, the "
        "job pushes in full (a wire as fast as memory).",
    )
    push_update: Literal["bracket", "in_place"] = Field(
        "bracket",
        description="How a full-weight push treats samples running on the engines. bracket: they are "
        "aborted at the update, so no sample mixes two weight versions (the tinker SDK reports "
        "SampleAbortedError and does not send it again: the caller does). "
        "in_place: they pause with their KV cache and continue on the new weights (SGLang's in_place "
        "pause mode); the answer reports which version sampled which tokens (weight_versions) for "
        'off-policy correction. docs/weights.md "In-place updates".',
    )
    weight_api: Literal["current", "legacy"] = Field(
        "current", description="Engine weight-update dialect: current (SGLang >= 0.5.22) or legacy."
    )
    trainer_channel: bool = Field(
        True,
        description="Send trainer commands to each rank over a TCP stream of its own (its node IP, a port "
        "the OS picks, key-authenticated) instead of Ray actor calls: 2-2.5 ms less per command around "
        "a compute (docs/gateway.md). Where nodes reach each other on fixed ports only, it cannot open and "
        "the actor calls serve (logged); false = actor calls only.",
    )
    trainer_probe_interval_s: float = Field(
        2.0, gt=0, description="Seconds between trainer liveness probes (a dead trainer ends the driver)."
    )
    engine_startup_timeout_s: float = Field(600.0, gt=0, description="Bound on an engine's start.")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="Bound on reserving the GPUs once all nodes joined; errors name what lacks."
    )
    ray_connect_timeout_s: float = Field(
        60.0, gt=0, description="Bound on the driver's connection to the job's Ray head (GCS)."
    )
    max_loaded_adapters: int = Field(
        16, ge=1, description="LoRA sampler snapshots kept loaded on the engines (least recently used go)."
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Per-request token budget of forward_backward (model_input tokens of the whole batch); "
        "a larger batch is refused as the caller's error. None = no budget.",
    )
    lora_batch_window_ms: float | None = Field(
        None,
        ge=0,
        description="How long a LoRA forward_backward (or optim_step) may wait for other models' requests "
        "to share one command: one pass over the base (one queue of AdamW steps). It waits only for models "
        "active in the last second (sent a request or got an answer), and no longer once each of them has "
        "one waiting, so a tenant next to idle ones pays nothing. 0 = no batching. None = 5 ms, or 0 "
        "with elastic training (which does not support merged passes). On one H200, 4 tenants x 2 x 2048 "
        "tokens on the Qwen3-0.6B shape, the batched step ran 1.64x and 1.49x the sequential one in two "
        "runs (1.54x over both), and a median 1.84x (1.64-2.14x) over 10 interleaved rounds in a third; "
        "5 ms is 2.7-5% of one tenant's training pass there (bench/results/gpu-multi-tenant-lora.md).",
    )

    @field_validator("state_key_prefix")
    @classmethod
    def _state_key_prefix(cls, value: str | None) -> str | None:
        if value is not None and not SAFE_NAME.fullmatch(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        return value


# The elastic controller (miles.elastic.policy) decides with this section itself: no runtime copy of it.
class ElasticOptions(StrictModel):
    """Elastic hybrid training (docs/elastic.md): idle engines lent to the trainer as extra DP lanes."""

    enabled: bool = Field(False, description="Lend idle engines' GPUs to the trainer as hybrid lanes.")
    min_rollout_gpus: int = Field(
        1, ge=0, description="GPUs that always stay with serving engines; a borrow below it is refused."
    )
    idle_window_s: float = Field(
        30.0, ge=0, description="Seconds without sampling in flight before an engine may be borrowed."
    )
    max_hybrid_lanes: int = Field(1, ge=1, description="Engines lent at once at most.")
    # A loan costs two process starts (lane up, engine back: about 40 s on CPU, docs/elastic.md's numbers),
    # so one given back sooner spends more than it earns; 60 s keeps every loan at least 1.5x its own cost.
    min_loan_s: float = Field(
        60.0,
        ge=0,
        description="Seconds a lent engine stays lent before sampling demand or an empty training queue "
        "may take it back (a loan costs two process starts; a dead lane's engine returns at once).",
    )
