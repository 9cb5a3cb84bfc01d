"""The whole preset: its sections, the checks across them (all problems at once, each naming its key),
and resolution (every default that depends on other fields filled, so the run directory's YAML is
explicit)."""

from __future__ import annotations

import yaml
from pydantic import Field, field_validator, model_validator

from miles.contract.layout import context_problems, gpu_problems, train_mode_problems
from miles.contract.ports import daemon_port_clashes, fixed_node_ports
from miles.contract.preset.base import SAFE_NAME, EnvMap, StrictModel, check_env_names
from miles.contract.preset.catalog import CatalogDefaults, CatalogEntry, catalog_problems
from miles.contract.preset.colocate import ColocateOptions, colocate_problems, resolve_colocate
from miles.contract.preset.engines import EngineOptions
from miles.contract.preset.gateway import GatewayOptions, WatchdogOptions
from miles.contract.preset.model import ModelOptions, ParallelLayout
from miles.contract.preset.ray import RayOptions
from miles.contract.preset.runtime import CommandOptions, ElasticOptions, RuntimeOptions
from miles.contract.preset.scheduler import SchedulerOptions, resolve_pbs, resolve_slurm
from miles.contract.preset.selftest import SelftestOptions


class Preset(StrictModel):
    name: str = Field(description="Preset name (letters, digits, `.`, `_`, `-`).")
    description: str = Field("", description="One line for `launcher presets list`.")
    nodes: int = Field(1, ge=1, description="Nodes in the allocation.")
    train_nodes: int = Field(1, ge=1, description="Trainer nodes (the first ones in role order).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (logical GPUs on CPU-only nodes).")
    scheduler: SchedulerOptions = Field(default_factory=SchedulerOptions, description="Scheduler options.")
    model: ModelOptions = Field(description="The base model.")
    engines: EngineOptions = Field(default_factory=EngineOptions, description="Inference engines.")
    colocate: ColocateOptions = Field(
        default_factory=ColocateOptions,
        description="Trainer and engines sharing every GPU (colocated) instead of split roles.",
    )
    gateway: GatewayOptions = Field(default_factory=GatewayOptions, description="The Tinker gateway.")
    watchdog: WatchdogOptions = Field(default_factory=WatchdogOptions, description="The healthz watchdog.")
    ray: RayOptions = Field(default_factory=RayOptions, description="Ray bring-up.")
    env: EnvMap = Field(default_factory=dict, description="Extra environment of every process.")
    driver: CommandOptions = Field(
        default_factory=CommandOptions,
        description="Driver argv; none = `python -m miles.driver.serve <run_dir>/preset.yaml`.",
    )
    services: CommandOptions = Field(
        default_factory=CommandOptions, description="Command started once the gateway is healthy."
    )
    runtime: RuntimeOptions = Field(
        default_factory=RuntimeOptions, description="Driver settings: state, checkpoints, weight push."
    )
    catalog: list[CatalogEntry] | None = Field(
        None, description="Models tenants may ask for (docs/catalog.md); none = model: alone, resident."
    )
    catalog_defaults: CatalogDefaults = Field(
        default_factory=CatalogDefaults, description="Job defaults of the catalog's handle leases."
    )
    elastic: ElasticOptions = Field(
        default_factory=ElasticOptions, description="Elastic hybrid training: borrowing idle engines."
    )
    selftest: SelftestOptions = Field(
        default_factory=SelftestOptions,
        description="The job checks its own pieces and ends (`launcher selftest`, docs/first-job.md).",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: EnvMap) -> EnvMap:
        return check_env_names(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not SAFE_NAME.fullmatch(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Preset:
        problems = _cross_field_problems(self)
        if problems:  # all at once: fixing them one resubmit at a time wastes the user's day
            raise ValueError("\n  ".join(problems))
        return self


# The one default of the batching window: the coalescer's DEFAULT_WINDOW_S is this in seconds, and the
# measurements behind 5 ms are with it (miles/train/coalescer.py).
DEFAULT_LORA_BATCH_WINDOW_MS = 5.0


def lora_batch_window_ms(preset: Preset) -> float:
    """The batching window the job runs with: the preset's, else the default (0 with elastic training)."""
    if preset.runtime.lora_batch_window_ms is not None:
        return preset.runtime.lora_batch_window_ms
    return 0.0 if preset.elastic.enabled else DEFAULT_LORA_BATCH_WINDOW_MS


def state_key_prefix(preset: Preset) -> str:
    """Where this deployment's state lives in a shared store (the gateway's and the catalog's books)."""
    return preset.runtime.state_key_prefix or f"miles-{preset.name}"


def _parallel_problems(p: Preset) -> list[str]:
    """model.parallel against the trainer GPUs (the model's own shape is checked at submit, where its
    config.json is read: launcher.submit_checks)."""
    parallel = p.model.parallel
    if p.model.backend != "megatron":
        if parallel != ParallelLayout():
            return [
                "model.parallel: only model.backend megatron uses it; drop it or set model.backend=megatron"
            ]
        return []

    gpus = _trainer_gpus(p)
    problems = gpu_problems(parallel, gpus) if gpus else []
    problems += context_problems(parallel, p.model.max_context)
    return problems + train_mode_problems(parallel, p.model.train_mode)


def _trainer_gpus(p: Preset) -> int | None:
    """The trainer's GPUs where the preset fixes them (a one-node job's share is decided at bring-up)."""
    if p.nodes > 1:
        return p.train_nodes * p.gpus_per_node
    if p.engines.per_node is not None:
        return p.gpus_per_node - p.engines.per_node * p.engines.tp_size
    return None


def _cross_field_problems(p: Preset) -> list[str]:
    problems = []
    if p.nodes == 1 and p.train_nodes != 1:
        problems.append("train_nodes: a 1-node job has train_nodes 1 (the node holds both roles)")
    # a colocated job trains on every node (its check says so); split roles keep the head an engine node
    if p.nodes > 1 and p.train_nodes >= p.nodes and not p.colocate.enabled:
        problems.append(
            f"train_nodes: {p.train_nodes} must be < nodes ({p.nodes}) so at least the head serves engines "
            "(or set colocate.enabled true: every node then trains and serves)"
        )
    tp = p.engines.tp_size
    if p.engines.kind == "sglang" and p.gpus_per_node < tp:
        problems.append(f"engines.tp_size: {tp} needs gpus_per_node >= {tp} (is {p.gpus_per_node})")
    elif p.gpus_per_node and p.gpus_per_node % tp:
        problems.append(f"engines.tp_size: {tp} must divide gpus_per_node ({p.gpus_per_node})")
    per_node = p.engines.per_node
    if per_node and p.engines.kind == "sglang" and per_node * tp > p.gpus_per_node:
        problems.append(
            f"engines.per_node: {per_node} x tp_size {tp} exceeds gpus_per_node {p.gpus_per_node}"
        )
    if p.model.init == "pretrained" and not p.model.path:
        problems.append("model.path: required when model.init is 'pretrained'")
    if p.model.init == "pretrained" and p.model.init_shape != "tiny":
        problems.append(
            f"model.init_shape: {p.model.init_shape} is the shape of a model built from scratch; "
            "model.init pretrained loads model.path as it is, so drop init_shape or set model.init tiny"
        )
    ray = p.ray
    if ray.node_port_base is not None and ray.node_port_base + 10 * p.nodes > 65535:
        problems.append(
            f"ray.node_port_base: {ray.node_port_base} + 10 x {p.nodes} nodes exceeds 65535: lower it to at "
            f"most {65535 - 10 * p.nodes} for {p.nodes} nodes, or unset it (each node then picks free ports)"
        )
    problems += _daemon_port_problems(p)
    problems += _elastic_problems(p)
    problems += colocate_problems(p)
    problems += catalog_problems(p)
    if p.selftest.enabled and p.catalog is not None:
        problems.append(
            "selftest.enabled: the self-test checks the job's resident model; a catalog job has none "
            "(self-test a preset of one of its models instead)"
        )
    problems += _parallel_problems(p)
    problems += _push_delta_problems(p)
    span = ray.worker_ports_per_node
    if ray.worker_port_base is not None and ray.worker_port_base + span * p.nodes > 65536:
        problems.append(
            f"ray.worker_port_base: {p.nodes} nodes x {span} worker ports from {ray.worker_port_base} exceed "
            f"65535: lower it to at most {max(1, 65536 - span * p.nodes)}, shrink ray.worker_ports_per_node, "
            "or unset it (each node then picks its own range)"
        )
    return problems


def _push_delta_problems(p: Preset) -> list[str]:
    """What the delta push and in-place updates cannot serve, said at submit time (docs/weights.md)."""
    problems = []
    if p.runtime.push_update == "in_place" and p.colocate.enabled:
        problems.append(
            "runtime.push_update: in_place keeps samples running across a push, but a colocated job's "
            "engines release their memory to the trainer between samples; set runtime.push_update bracket"
        )
    if not p.runtime.push_delta:
        return problems
    if p.engines.kind != "cpu":
        problems.append(
            "runtime.push_delta: SGLang engines cannot apply a delta (its update_weights_from_distributed "
            "takes no custom format and would read one as plain tensors); use engines.kind cpu or set "
            "runtime.push_delta false"
        )
    if p.colocate.enabled:
        problems.append(
            "runtime.push_delta: a colocated push hands the engines CUDA IPC handles and moves no bytes, so "
            "a delta saves nothing; set runtime.push_delta false"
        )
    if p.model.train_mode != "full":
        problems.append(
            f"runtime.push_delta: model.train_mode {p.model.train_mode} pushes its base once and then "
            "adapter files; deltas apply to full fine-tuning only: set runtime.push_delta false"
        )
    return problems


def _elastic_problems(p: Preset) -> list[str]:
    """What elastic training cannot do, said at submit time: a reserve that every engine GPU is needed
    for (nothing could ever be lent), a megatron trainer other than full fine-tuning at tensor, pipeline
    and context parallel 1 (its lanes are DP replicas of that layout), a catalog (its instances have no
    driver loop), merged LoRA passes (the lanes split single ones)."""
    if not p.elastic.enabled or p.colocate.enabled:  # colocated: colocate_problems refuses elastic alone
        return []
    problems = []
    engine_gpus = (p.nodes - p.train_nodes) * p.gpus_per_node
    if p.nodes > 1 and engine_gpus <= p.elastic.min_rollout_gpus:
        problems.append(
            f"elastic.min_rollout_gpus: {p.elastic.min_rollout_gpus} keeps all {engine_gpus} engine GPUs "
            "serving, so no engine could ever be lent: lower it or set elastic.enabled false"
        )
    problems += _megatron_lane_problems(p)
    if p.catalog is not None:
        problems.append("elastic.enabled: a job with a catalog: is not supported; drop one of them")
    if lora_batch_window_ms(p) > 0:  # a merged pass would train on the core alone, unrecoverably
        problems.append(
            "elastic.enabled: runtime.lora_batch_window_ms > 0 (tenants' passes merged) is not supported "
            "with elastic training; set it to 0 or set elastic.enabled false"
        )
    return problems


def _megatron_lane_problems(p: Preset) -> list[str]:
    """Megatron lanes are DP 1 replicas of a full fine-tuning core at TP, PP and CP 1 (docs/elastic.md)."""
    if p.model.backend != "megatron":
        return []
    problems = []
    if p.model.train_mode != "full":
        problems.append(
            "elastic.enabled: model.backend megatron lends engines to full fine-tuning only (LoRA adapters "
            "on megatron lanes are not built); set model.train_mode full, model.backend transformers, or "
            "elastic.enabled false"
        )
    layout = p.model.parallel
    sizes = {"tensor": layout.tensor, "pipeline": layout.pipeline, "context": layout.context}
    if any(size != 1 for size in sizes.values()):
        shown = ", ".join(f"{k} {v}" for k, v in sizes.items())
        problems.append(
            f"elastic.enabled: megatron lanes need model.parallel tensor, pipeline and context 1 (got "
            f"{shown}): a lane is a whole replica on one engine's GPU; set them to 1 or elastic.enabled false"
        )
    return problems


def _daemon_port_problems(p: Preset) -> list[str]:
    """Fixed ports that a scheduler daemon (PBS, Slurm) listens on, on every node."""
    ray, span = p.ray, p.ray.worker_ports_per_node
    pinned: dict[str, list[int]] = {
        "ray.gcs_port": [ray.gcs_port] if ray.gcs_port is not None else [],
        "ray.client_server_port": [ray.client_server_port] if ray.client_server_port is not None else [],
        "gateway.port": [p.gateway.port] if p.gateway.port is not None else [],
        "ray.node_port_base": fixed_node_ports(ray.node_port_base, p.nodes)
        if ray.node_port_base is not None
        else [],
        "ray.worker_port_base": list(range(ray.worker_port_base, ray.worker_port_base + span * p.nodes))
        if ray.worker_port_base is not None
        else [],
    }
    return [
        f"{key}: pins port {', '.join(clashes)}, which that daemon listens on on every node: pick ports "
        "that avoid it, or unset it (ports are then picked free on each node)"
        for key, ports in pinned.items()
        if (clashes := daemon_port_clashes(ports))
    ]


def resolve(preset: Preset) -> Preset:
    """Fill every default that depends on other fields, so the YAML written to the run dir is explicit."""
    resolved = preset.model_copy(deep=True)
    default_name = f"miles-{resolved.name}"
    if resolved.scheduler.pbs.job_name is None:
        resolved.scheduler.pbs.job_name = default_name
    if resolved.scheduler.slurm.job_name is None:
        resolved.scheduler.slurm.job_name = default_name
    resolve_slurm(resolved.scheduler.slurm, resolved.gpus_per_node)
    resolve_pbs(resolved.scheduler.pbs, resolved.gpus_per_node)
    resolve_colocate(resolved)  # before the split default of engines.per_node: one engine per GPU
    if resolved.engines.per_node is None:
        gpus, tp = resolved.gpus_per_node, resolved.engines.tp_size
        resolved.engines.per_node = max(1, gpus // tp) if resolved.engines.kind == "sglang" else 1
    resolved.env.setdefault("RAY_AUTH_MODE", "disabled")
    return Preset.model_validate(resolved.model_dump())


def preset_to_yaml(preset: Preset) -> str:
    """The resolved preset as YAML: every default filled, loadable again with `load_preset`."""
    return yaml.safe_dump(resolve(preset).model_dump(mode="json"), sort_keys=False, width=1000)
