"""`colocate:`: the whole job on every GPU, trainer ranks and engines sharing each one
(docs/concepts-roles.md, "Split or colocated"), and what each side gives up while the other works."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from miles.contract.preset.base import StrictModel

if TYPE_CHECKING:  # the whole preset holds this section: annotations only
    from miles.contract.preset.preset import Preset

TrainerOffload = Literal["optimizer", "gradients"]
EngineRelease = Literal["weights", "kv_cache"]

# What the engines release while the trainer works, when the preset does not say. Full fine-tuning pushes
# every weight after each step anyway, so the engines' copy can go; in LoRA mode the engines' base weights
# never change, and re-pushing the whole base after each step would cost more than the memory it frees.
DEFAULT_ENGINE_RELEASE: dict[str, tuple[EngineRelease, ...]] = {
    "full": ("weights", "kv_cache"),
    "lora": ("kv_cache",),
}


# Engine kinds started with `--enable-memory-saver` when colocated: SGLang releases and resumes its weights
# and KV cache only with it, and the CPU engine mirrors that flag.
MEMORY_SAVER_KINDS: tuple[str, ...] = ("sglang", "cpu")
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def _unique(value: list[str], what: str) -> list[str]:
    repeated = sorted({item for item in value if value.count(item) > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)} listed more than once: name each {what} once")
    return value


class ColocateOptions(StrictModel):
    """Colocated training: the trainer ranks and the engines share every GPU of the job, taking turns
    (the engines sample, then the trainer steps), instead of split roles (trainer nodes and engine nodes).
    Transformers backend, engines of one GPU (tp_size 1), one engine per GPU, every node a trainer node
    (train_nodes = nodes); no elastic training, no catalog. When to choose which, with the memory
    arithmetic of both: docs/concepts-roles.md."""

    enabled: bool = Field(
        False,
        description="Trainer ranks and engines share every GPU of the job (one trainer rank and one engine "
        "per GPU, train_nodes = nodes; SGLang starts with enable_memory_saver); false = split roles "
        "(trainer nodes, engine nodes).",
    )
    trainer_offload: list[TrainerOffload] = Field(
        default_factory=list,
        description="What the trainer moves off the GPU to host memory while the engines sample: "
        "`optimizer` (Adam's two states per parameter, the largest part of full fine-tuning), `gradients`. "
        "[] keeps everything resident (fastest turn-around, most memory).",
    )
    engine_release: list[EngineRelease] | None = Field(
        None,
        description="What the engines give back while the trainer works: `weights` (pushed again after the "
        "step), `kv_cache` (cached prompt prefixes are lost: the next prompts are prefilled again). "
        "None = [weights, kv_cache] with "
        "model.train_mode full, [kv_cache] with lora (the base weights never change in LoRA mode, and "
        "pushing them again every step would cost more than the memory frees); [] = release nothing.",
    )

    @field_validator("trainer_offload")
    @classmethod
    def _offload_once(cls, value: list[TrainerOffload]) -> list[TrainerOffload]:
        _unique(list(value), "state")
        return value

    @field_validator("engine_release")
    @classmethod
    def _release_once(cls, value: list[EngineRelease] | None) -> list[EngineRelease] | None:
        if value is not None:
            _unique(list(value), "tag")
        return value


def engine_release_tags(preset: Preset) -> list[str]:
    """What the engines release while the trainer works: `colocate.engine_release`, else the train mode's
    default. [] when the job is not colocated (split engines keep their GPUs to themselves)."""
    return list(_engine_release(preset))


def _engine_release(preset: Preset) -> list[EngineRelease]:
    if not preset.colocate.enabled:
        return []
    if preset.colocate.engine_release is not None:
        return list(preset.colocate.engine_release)
    return list(DEFAULT_ENGINE_RELEASE[preset.model.train_mode])


def colocate_problems(p: Preset) -> list[str]:
    """What colocation cannot do (yet), each with the key to change; settings of a job that is not
    colocated are refused too, so that nobody believes an offload is on when it is not."""
    c = p.colocate
    if not c.enabled:
        stray = ["trainer_offload"] if c.trainer_offload else []
        stray += ["engine_release"] if c.engine_release is not None else []
        return [
            f"colocate.{key}: only a colocated job uses it; drop it or set colocate.enabled true"
            for key in stray
        ]
    off = "or set colocate.enabled false"
    problems = []
    if p.model.backend != "transformers":
        problems.append(
            f"colocate.enabled: model.backend {p.model.backend} cannot colocate yet (megatron colocation is "
            f"not built); set model.backend transformers {off}"
        )
    if p.engines.tp_size != 1:
        problems.append(
            f"engines.tp_size: {p.engines.tp_size} with colocate.enabled; colocated engines have one GPU "
            f"each (the weight update sends each engine one payload per trainer rank): set it to 1 {off}"
        )
    if p.elastic.enabled:
        problems.append(
            "elastic.enabled: a colocated job has no idle engine GPUs to lend (every GPU trains too); "
            f"set elastic.enabled false {off}"
        )
    if p.train_nodes != p.nodes:
        problems.append(
            f"train_nodes: {p.train_nodes} with colocate.enabled; every node of a colocated job trains and "
            f"serves, so set train_nodes to nodes ({p.nodes}) {off}"
        )
    if p.gpus_per_node < 1:
        problems.append(
            "gpus_per_node: colocate.enabled needs at least 1 GPU per node (logical GPUs on CPU nodes) to "
            f"share; set gpus_per_node {off}"
        )
    per_node = p.engines.per_node
    if per_node is not None and p.gpus_per_node >= 1 and per_node != p.gpus_per_node:
        problems.append(
            f"engines.per_node: {per_node} with colocate.enabled; a colocated job runs one engine per GPU, "
            f"so unset it or set it to gpus_per_node ({p.gpus_per_node}) {off}"
        )
    if p.catalog is not None:
        problems.append(f"catalog: a colocated job serves model: alone; drop catalog: {off}")
    if p.model.train_mode == "lora" and "weights" in (c.engine_release or []):
        problems.append(
            "colocate.engine_release: weights with model.train_mode lora; a LoRA job never pushes the base "
            "weights, so released ones would not come back: use [kv_cache] (the default) or []"
        )
    if p.engines.server_args.get("enable_memory_saver", True) is not True:
        problems.append(
            "engines.server_args.enable_memory_saver: colocated engines need it to release memory for the "
            "trainer; drop the key (colocate.enabled turns it on) or set colocate.enabled false"
        )
    return problems


def resolve_colocate(preset: Preset) -> None:
    """A colocated job's defaults, written out: what the engines release (by train mode), one engine per
    GPU, the engines' memory saver on (SGLang releases and resumes weights and KV cache only with it), and
    SGLang's /health without its generation."""
    if not preset.colocate.enabled:
        return
    preset.colocate.engine_release = _engine_release(preset)
    if preset.engines.per_node is None and preset.gpus_per_node >= 1:
        preset.engines.per_node = preset.gpus_per_node
    if preset.engines.kind in MEMORY_SAVER_KINDS:
        preset.engines.server_args.setdefault("enable_memory_saver", True)
    if preset.engines.kind == "sglang":
        # SGLang's /health generates a token: a probe in flight when the engine releases its memory makes
        # the release fail ("not idle"), and a probe of a released engine hangs. Liveness is HTTP alone.
        preset.engines.env.setdefault(HEALTH_GENERATION_ENV, "0")
