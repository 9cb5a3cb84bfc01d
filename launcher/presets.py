"""Presets: pydantic models of a job, loading from YAML, `--set` overrides, validation, resolution.

A preset is the one thing that crosses from the launcher to the runtime: the launcher writes the
resolved form (every default filled) into the run directory and the job script hands it to the driver.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from launcher import strict_yaml
from launcher.catalog_preset import CatalogDefaults, CatalogEntry, catalog_problems
from launcher.layers import Layered
from launcher.ports import daemon_port_clashes, fixed_node_ports
from launcher.shipped import shipped_dir
from launcher.walltimes import pbs_walltime, slurm_time

DEAD_PROBES_ENV = "GATEWAY_DEAD_PROBES"
PRESETS_DIR = shipped_dir("presets")

# Ray's AF_UNIX socket paths live under the temp dir and must stay below 107 bytes; the session
# directory and socket names Ray appends take about 70 of them.
MAX_RAY_TEMP_DIR_LEN = 32
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_COUNT = re.compile(r"0|[1-9][0-9]*")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# A dead-probe count beyond this is a typo, not a policy (10000 probes at 30 s is about 3.5 days)
MAX_DEAD_PROBES = 10_000


def _env_values_as_text(value: Any) -> Any:
    """`OMP_NUM_THREADS: 4` means the text "4": numbers and booleans become the text YAML wrote."""
    if not isinstance(value, dict):
        return value
    return {key: _env_text(key, item) for key, item in value.items()}


def _env_text(key: Any, item: Any) -> str:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return str(item)
    if item is None:
        return ""
    if not isinstance(item, str):
        raise ValueError(
            f"{key}: an environment value is text, a number or a boolean, not {type(item).__name__}"
        )
    return item


EnvMap = Annotated[dict[str, str], BeforeValidator(_env_values_as_text)]
Port = Annotated[int, Field(ge=1, le=65535)]


class PresetError(ValueError):
    """A preset (or an override of it) is invalid; the message names the offending key."""


def parse_dead_probes(value: str, name: str = DEAD_PROBES_ENV) -> int:
    """Parse a dead-probe count: a plain decimal integer 0..MAX_DEAD_PROBES, no sign, no leading zero."""
    if not isinstance(value, str) or not _PLAIN_COUNT.fullmatch(value):
        raise PresetError(
            f"{name}={value!r} is not a plain non-negative count: use digits only, without sign, "
            "spaces, decimals or leading zeros (e.g. 4; 0 disables the watchdog's exit)"
        )
    if len(value) > len(str(MAX_DEAD_PROBES)) or int(value) > MAX_DEAD_PROBES:
        raise PresetError(f"{name}={value!r} is too large: at most {MAX_DEAD_PROBES} (0 never exits)")
    return int(value)


def _check_env_names(env: EnvMap) -> EnvMap:
    for key in env:
        if not _ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
    return env


class _Model(BaseModel):
    # strict: no YAML 1.1 style coercion (a boolean or the text "8" is not an integer)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class PbsOptions(_Model):
    """PBS Professional directives (ABCI style: -P group, -q resource type, -l select, -l walltime)."""

    project: str | None = Field(None, description="Group passed as `#PBS -P` (ABCI: required).")
    project_required: bool = Field(
        False, description="Refuse to submit without a real `project` (ABCI: every job names its group)."
    )
    queue: str | None = Field(None, description="Queue / resource type passed as `#PBS -q` (ABCI: rt_HF).")
    whole_nodes: bool = Field(
        False,
        description="The queue allocates whole nodes (ABCI rt_HF): `-l select=N` only, no chunk "
        "resources and no `-l place`.",
    )
    ncpus: int | None = Field(None, ge=1, description="Chunk `ncpus`; none = not asked (site default).")
    ngpus: int | None = Field(
        None, ge=0, description="Chunk `ngpus`; default = the preset's gpus_per_node; 0 = not asked."
    )
    select_extras: str = Field(
        "", description="Appended to the chunk of `-l select=`, e.g. `:mpiprocs=1:mem=64gb`; empty for none."
    )
    place: str | None = Field(
        "scatter:excl", description="`-l place=`: one chunk per node, nodes not shared; none = not asked."
    )
    walltime: str = Field(
        "01:00:00",
        description="`#PBS -l walltime=`, [[HH:]MM:]SS (minutes, seconds 0-59); a number is seconds.",
    )
    rerunnable: bool = Field(
        False,
        description="`-r y`: PBS may rerun the job after a node failure or preemption (default `-r n`).",
    )
    job_name: str | None = Field(None, description="`#PBS -N`; default `miles-<preset name>`.")
    extra_directives: list[str] = Field(
        default_factory=list, description="Extra `#PBS` lines, each without the `#PBS ` prefix."
    )
    launch: Literal["pbs_tmrsh", "pbsdsh", "mpirun", "ssh"] = Field(
        "pbs_tmrsh",
        description="How the job starts Ray on the other nodes: `pbs_tmrsh HOST` (PBS's TM interface, "
        "processes stay under the job), `pbsdsh -n INDEX`, `mpirun` (binding off) or `ssh`.",
    )
    mpi: Literal["openmpi", "intelmpi"] = Field(
        "openmpi",
        description="launch mpirun: whose mpirun (Open MPI `--bind-to none`, Intel MPI `I_MPI_PIN=0`).",
    )

    @field_validator("walltime", mode="before")
    @classmethod
    def _walltime(cls, value: Any) -> str:
        return pbs_walltime(value)

    @field_validator("select_extras")
    @classmethod
    def _select(cls, value: str) -> str:
        if value and not re.fullmatch(r"(:[A-Za-z_]+=[A-Za-z0-9_.]+)+", value):
            raise ValueError("select_extras must be ':key=value' pairs, e.g. ':mpiprocs=1:mem=64gb'")
        if value and re.search(r":(ncpus|ngpus)=", value):
            raise ValueError("set ncpus and ngpus with scheduler.pbs.ncpus / scheduler.pbs.ngpus")
        return value

    @field_validator("place")
    @classmethod
    def _place(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z]+(:[a-z]+(=[A-Za-z0-9_]+)?)*", value):
            raise ValueError("place must look like scatter:excl, pack, free:shared or vscatter")
        return value


class SlurmOptions(_Model):
    """Slurm `#SBATCH` options."""

    partition: str | None = Field(None, description="`--partition`; none = the cluster default.")
    account: str | None = Field(None, description="`--account`; none = your default account.")
    time: str = Field(
        "01:00:00",
        description="`--time`, e.g. 01:00:00 or 2-00:00:00 (fields in range); a number is minutes.",
    )
    gpus_per_node: int | None = Field(
        None, ge=0, description="`--gpus-per-node`; default = the preset's gpus_per_node; 0 = no GPU request."
    )
    exclusive: bool | None = Field(
        None, description="`--exclusive` (whole nodes); default: on when the job asks for GPUs."
    )
    cpus_per_task: int | None = Field(
        None,
        ge=1,
        description="`--cpus-per-task` (one task per node: the CPUs Ray gets); none = Slurm default.",
    )
    mem: str | None = Field(
        None,
        description="`--mem` per node, e.g. 200G; default `0` (all of it) when exclusive, else not asked.",
    )
    signal: str | None = Field(
        "B:USR1@120",
        description="`--signal`: the batch shell gets USR1 this many seconds before the time limit and "
        "shuts down in order; none = not asked.",
    )
    requeue: bool = Field(False, description="`--requeue` (opt-in); default `--no-requeue`.")
    job_name: str | None = Field(None, description="`--job-name`; default `miles-<preset name>`.")
    extra_directives: list[str] = Field(
        default_factory=list, description="Extra `#SBATCH` lines, each without the `#SBATCH ` prefix."
    )

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: Any) -> str:
        return slurm_time(value)

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"\d+[KMGT]?", value):
            raise ValueError("mem must be a size like 0, 64000, 200G (0 = all of the node's memory)")
        return value

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(B:|R:|RB:|BR:)?(USR1|USR2|TERM|INT|URG)@\d+", value):
            raise ValueError("signal must look like B:USR1@120 ([B:]SIGNAL@SECONDS)")
        return value


class SchedulerOptions(_Model):
    pbs: PbsOptions = Field(default_factory=PbsOptions, description="PBS Professional options.")
    slurm: SlurmOptions = Field(default_factory=SlurmOptions, description="Slurm options.")


class ParallelOptions(_Model):
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
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation: none, selective (attention core) or full (each layer)."
    )


class ModelOptions(_Model):
    name: str = Field(description="Base model name clients use (tinker `base_model`).")
    path: str | None = Field(
        None, description="Hugging Face directory or hub name; required unless init is tiny."
    )
    init: Literal["pretrained", "tiny"] = Field(
        "pretrained", description="`tiny`: the driver builds the tiny test model into the run dir."
    )
    backend: Literal["transformers", "megatron"] = Field("transformers", description="Training backend.")
    train_mode: Literal["lora", "full"] = Field("lora", description="LoRA adapters or full fine-tuning.")
    lora_rank: int = Field(32, ge=1, description="LoRA rank (train_mode lora).")
    max_context: int = Field(4096, ge=16, description="Maximum sequence length in tokens.")
    parallel: ParallelOptions = Field(
        default_factory=ParallelOptions, description="Megatron parallel sizes (model.backend: megatron)."
    )


class EngineOptions(_Model):
    kind: Literal["sglang", "cpu"] = Field("sglang", description="SGLang servers or the CPU engine.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs per engine.")
    per_node: int | None = Field(
        None, ge=1, description="Engines per engine node; default gpus_per_node / tp_size (cpu: 1)."
    )
    server_args: dict[str, Any] = Field(default_factory=dict, description="Extra engine server arguments.")
    env: EnvMap = Field(default_factory=dict, description="Extra environment of engine processes.")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: EnvMap) -> EnvMap:
        return _check_env_names(value)


class ApiKeySource(_Model):
    """Where the gateway's API key comes from: exactly one of a file or an environment variable."""

    file: str | None = Field(None, description="Path of a file holding the key.")
    env: str | None = Field(None, description="Name of an environment variable holding the key.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeySource:
        if (self.file is None) == (self.env is None):
            raise ValueError("give exactly one of 'file' or 'env' (omit api_key to generate a key)")
        if self.env is not None and not _ENV_NAME.fullmatch(self.env):
            raise ValueError(f"env: {self.env!r} is not a valid environment variable name")
        return self


class GatewayOptions(_Model):
    host: str = Field("0.0.0.0", description="Bind address; a specific address is also the probe address.")
    port: Port | None = Field(
        None, description="Gateway port on the head node; none = picked free when the job starts."
    )
    api_key: ApiKeySource | None = Field(
        None, description="`{file: PATH}` or `{env: NAME}`; none = generated."
    )
    tls_certfile: str | None = Field(
        None, description="PEM certificate (chain) to serve https; with tls_keyfile. None = plain http."
    )
    tls_keyfile: str | None = Field(None, description="PEM private key of tls_certfile (keep it mode 0600).")
    max_body_mb: int = Field(
        128,  # the gateway's own default (miles.gateway.settings.DEFAULT_MAX_BODY_BYTES)
        gt=0,
        description="Largest request body the gateway takes, in MiB (a zstd body counts decompressed); "
        "larger is a 413.",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewayOptions:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("gateway.tls_certfile and gateway.tls_keyfile go together: give both or neither")
        return self


class WatchdogOptions(_Model):
    dead_probes: int = Field(
        4,
        le=MAX_DEAD_PROBES,
        description=f"Consecutive 503 probes that end the job; 0 = never exit. Env {DEAD_PROBES_ENV}.",
    )
    probe_interval_s: float = Field(30.0, gt=0, description="Seconds between probes once healthy.")
    startup_probe_interval_s: float = Field(10.0, gt=0, description="Seconds between startup probes.")
    startup_timeout_s: float = Field(3600.0, gt=0, description="Give up if never healthy by then.")

    @field_validator("dead_probes", mode="before")
    @classmethod
    def _count(cls, value: Any) -> int:
        if isinstance(value, str):
            return parse_dead_probes(value, name="watchdog.dead_probes")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{value!r} is not a plain non-negative count")
        return value


class NodeIpOptions(_Model):
    mode: Literal["hostname", "interface", "prefix", "loopback-index"] = Field(
        "hostname",
        description="hostname: resolve the node name; interface: the IPv4 of `interface` on each node; "
        "prefix: the node's IPv4 starting with `prefix`; loopback-index (TEST MODE): node i of the "
        "allocation gets 127.0.0.(2+i).",
    )
    interface: str | None = Field(None, description="Network interface name (mode interface).")
    prefix: str | None = Field(None, description="Address prefix such as `10.1.` (mode prefix).")

    @model_validator(mode="after")
    def _needs(self) -> NodeIpOptions:
        if self.mode == "interface" and not self.interface:
            raise ValueError("mode 'interface' needs 'interface' (e.g. ib0)")
        if self.mode == "prefix" and not self.prefix:
            raise ValueError("mode 'prefix' needs 'prefix' (e.g. '10.1.')")
        return self


class RayOptions(_Model):
    """Ray bring-up: per-job ports so jobs sharing nodes never collide, and a short temp dir.

    A port left unset is picked free when the job starts, on the node that binds it, and claimed there
    (`<ray.temp_dir>-ports/`) so that two jobs starting at once never pick the same one; the ports a job
    uses are written to `<run_dir>/ports/` and shown by `launcher status`.
    """

    gcs_port: Port | None = Field(None, description="GCS port of the head; none = picked per job.")
    client_server_port: Port | None = Field(
        None, description="Ray client server port of the head; none = picked per job."
    )
    node_port_base: Port | None = Field(
        None,
        description="Fixed plan: node i uses base+10i .. base+10i+5 (node manager, object manager, agents, "
        "metrics); none = each node picks 6 free ports.",
    )
    worker_port_base: Port | None = Field(
        None, description="Fixed plan: node i's workers use base+i*span .. +span-1; none = picked per node."
    )
    worker_ports_per_node: int = Field(200, ge=16, description="Worker port span per node.")
    temp_dir: str = Field(
        "/tmp/miles-ray", description=f"Base of the per-job temp dirs (at most {MAX_RAY_TEMP_DIR_LEN} chars)."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs Ray advertises per node; none = detected.")
    object_store_memory_mb: int | None = Field(None, ge=64, description="Object store size; none = Ray's.")
    start_timeout_s: float = Field(300.0, gt=0, description="Bound on waiting for every node to join.")
    node_ip: NodeIpOptions = Field(default_factory=NodeIpOptions, description="How node IPs are chosen.")

    @field_validator("temp_dir")
    @classmethod
    def _temp_dir(cls, value: str) -> str:
        if not value.startswith("/") or len(value) > MAX_RAY_TEMP_DIR_LEN:
            raise ValueError(
                f"must be an absolute path of at most {MAX_RAY_TEMP_DIR_LEN} characters "
                "(Ray's socket paths below it are limited to 107 bytes)"
            )
        return value


class CommandOptions(_Model):
    command: list[str] | None = Field(None, description="argv list; none = the default.")


class RuntimeOptions(_Model):
    """What the driver (`miles.serve`) needs beyond the roles: state, checkpoints, the weight push."""

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
        "5 ms is 2.7-5% of one tenant's training pass there (docs/gpu.md).",
    )

    @field_validator("state_key_prefix")
    @classmethod
    def _state_key_prefix(cls, value: str | None) -> str | None:
        if value is not None and not _SAFE_NAME.fullmatch(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        return value


DEFAULT_LORA_BATCH_WINDOW_MS = 5.0  # miles.train.coalescer.DEFAULT_WINDOW_S, in ms (a test keeps them equal)


def lora_batch_window_ms(preset: Preset) -> float:
    """The batching window the job runs with: the preset's, else the default (0 with elastic training)."""
    if preset.runtime.lora_batch_window_ms is not None:
        return preset.runtime.lora_batch_window_ms
    return 0.0 if preset.elastic.enabled else DEFAULT_LORA_BATCH_WINDOW_MS


def state_key_prefix(preset: Preset) -> str:
    """Where this deployment's state lives in a shared store (the gateway's and the catalog's books)."""
    return preset.runtime.state_key_prefix or f"miles-{preset.name}"


class ElasticOptions(_Model):
    """Elastic hybrid training (docs/elastic.md): idle engines lent to the trainer as extra DP lanes."""

    enabled: bool = Field(False, description="Lend idle engines' GPUs to the trainer as hybrid lanes.")
    min_rollout_gpus: int = Field(
        1, ge=0, description="GPUs that always stay with serving engines; a borrow below it is refused."
    )
    idle_window_s: float = Field(
        30.0, ge=0, description="Seconds without sampling in flight before an engine may be borrowed."
    )
    max_hybrid_lanes: int = Field(1, ge=1, description="Engines lent at once at most.")
    min_loan_s: float = Field(
        60.0,
        ge=0,
        description="Seconds a lent engine stays lent before sampling demand or an empty training queue "
        "may take it back (a loan costs two process starts; a dead lane's engine returns at once).",
    )


class Preset(_Model):
    name: str = Field(description="Preset name (letters, digits, `.`, `_`, `-`).")
    description: str = Field("", description="One line for `launcher presets list`.")
    nodes: int = Field(1, ge=1, description="Nodes in the allocation.")
    train_nodes: int = Field(1, ge=1, description="Trainer nodes (the first ones in role order).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (logical GPUs on CPU-only nodes).")
    scheduler: SchedulerOptions = Field(default_factory=SchedulerOptions, description="Scheduler options.")
    model: ModelOptions = Field(description="The base model.")
    engines: EngineOptions = Field(default_factory=EngineOptions, description="Inference engines.")
    gateway: GatewayOptions = Field(default_factory=GatewayOptions, description="The Tinker gateway.")
    watchdog: WatchdogOptions = Field(default_factory=WatchdogOptions, description="The healthz watchdog.")
    ray: RayOptions = Field(default_factory=RayOptions, description="Ray bring-up.")
    env: EnvMap = Field(default_factory=dict, description="Extra environment of every process.")
    driver: CommandOptions = Field(
        default_factory=CommandOptions,
        description="Driver argv; none = `python -m miles.serve <run_dir>/preset.yaml`.",
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

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: EnvMap) -> EnvMap:
        return _check_env_names(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _SAFE_NAME.fullmatch(value):
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> Preset:
        problems = _cross_field_problems(self)
        if problems:  # all at once: fixing them one resubmit at a time wastes the user's day
            raise ValueError("\n  ".join(problems))
        return self


def _parallel_problems(p: Preset) -> list[str]:
    """model.parallel against the trainer GPUs (the model's own shape is checked at submit, where its
    config.json is read: launcher.submit_checks)."""
    parallel = p.model.parallel
    if p.model.backend != "megatron":
        if parallel != ParallelOptions():
            return [
                "model.parallel: only model.backend megatron uses it; drop it or set model.backend=megatron"
            ]
        return []
    from miles.train.megatron.layout import (
        ParallelLayout,
        context_problems,
        gpu_problems,
        train_mode_problems,
    )

    layout = ParallelLayout(**parallel.model_dump())
    gpus = _trainer_gpus(p)
    problems = gpu_problems(layout, gpus) if gpus else []
    problems += context_problems(layout, p.model.max_context)
    return problems + train_mode_problems(layout, p.model.train_mode)


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
    if p.nodes > 1 and p.train_nodes >= p.nodes:
        problems.append(
            f"train_nodes: {p.train_nodes} must be < nodes ({p.nodes}) so at least the head serves engines"
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
    ray = p.ray
    if ray.node_port_base is not None and ray.node_port_base + 10 * p.nodes > 65535:
        problems.append(
            f"ray.node_port_base: {ray.node_port_base} + 10 x {p.nodes} nodes exceeds 65535: lower it to at "
            f"most {65535 - 10 * p.nodes} for {p.nodes} nodes, or unset it (each node then picks free ports)"
        )
    problems += _daemon_port_problems(p)
    problems += _elastic_problems(p)
    problems += catalog_problems(p)
    problems += _parallel_problems(p)
    fixed_workers = ray.worker_port_base is not None
    span = ray.worker_ports_per_node
    if fixed_workers and ray.worker_port_base + span * p.nodes > 65536:
        problems.append(
            f"ray.worker_port_base: {p.nodes} nodes x {span} worker ports from {ray.worker_port_base} exceed "
            f"65535: lower it to at most {max(1, 65536 - span * p.nodes)}, shrink ray.worker_ports_per_node, "
            "or unset it (each node then picks its own range)"
        )
    return problems


def _elastic_problems(p: Preset) -> list[str]:
    """What elastic training cannot do, said at submit time: a reserve that every engine GPU is needed
    for (nothing could ever be lent), a trainer other than transformers (a lane is a whole-model
    transformers replica of the core's state), a catalog (its instances have no driver loop), merged
    LoRA passes (the lanes split single ones)."""
    if not p.elastic.enabled:
        return []
    problems = []
    engine_gpus = (p.nodes - p.train_nodes) * p.gpus_per_node
    if p.nodes > 1 and engine_gpus <= p.elastic.min_rollout_gpus:
        problems.append(
            f"elastic.min_rollout_gpus: {p.elastic.min_rollout_gpus} keeps all {engine_gpus} engine GPUs "
            "serving, so no engine could ever be lent: lower it or set elastic.enabled false"
        )
    if p.model.backend != "transformers":
        problems.append(
            f"elastic.enabled: model.backend {p.model.backend} is not supported (a hybrid lane is a "
            "whole-model copy of a transformers trainer's state, docs/elastic.md); set model.backend "
            "transformers or elastic.enabled false"
        )
    if p.catalog is not None:
        problems.append("elastic.enabled: a job with a catalog: is not supported; drop one of them")
    if lora_batch_window_ms(p) > 0:  # a merged pass would train on the core alone, unrecoverably
        problems.append(
            "elastic.enabled: runtime.lora_batch_window_ms > 0 (tenants' passes merged) is not supported "
            "with elastic training; set it to 0 or set elastic.enabled false"
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


# ---------------------------------------------------------------- loading and overrides


def list_presets() -> list[str]:
    """Names of the shipped presets (`presets/<name>.yaml`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """The YAML file of a shipped preset name, or the given path."""
    candidate = Path(name_or_path)
    looks_like_path = candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path
    if looks_like_path or candidate.is_file():
        if not candidate.is_file():
            raise PresetError(f"preset file {name_or_path!r} does not exist")
        return candidate.resolve()
    shipped = PRESETS_DIR / f"{name_or_path}.yaml"
    if not _SAFE_NAME.fullmatch(name_or_path) or not shipped.is_file():
        raise PresetError(
            f"unknown preset {name_or_path!r}: use one of {', '.join(list_presets())} "
            "or a path to a YAML file"
        )
    return shipped


SOURCE_PRESET = "preset"
SOURCE_ENV = "environment"
SOURCE_SET = "--set"


def load_preset(
    name_or_path: str,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = "defaults file",
) -> Preset:
    """Load a preset by shipped name or path, then apply the user's defaults, GATEWAY_DEAD_PROBES from
    `env` and the `--set` overrides, in that order (each wins over the ones before it).

    `defaults` is the preset part of the user's defaults file (the launcher reads it; the job does not).
    """
    return load_layers(name_or_path, overrides, env, defaults, defaults_source)[0]


def load_layers(
    name_or_path: str,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    defaults_source: str = "defaults file",
) -> tuple[Preset, Layered]:
    """`load_preset`, also returning the layers: which of them set each value."""
    path = preset_path(name_or_path)
    layered = Layered()
    layered.put_all(read_preset_file(path), SOURCE_PRESET)
    if defaults:
        layered.put_all(defaults, defaults_source)
    parsed = [parse_override(override) for override in overrides]
    env = os.environ if env is None else env
    overridden = any(parts[:2] in (["watchdog"], ["watchdog", "dead_probes"]) for parts, _ in parsed)
    if DEAD_PROBES_ENV in env and not overridden:  # --set wins, even over a bad value in the environment
        layered.put(("watchdog", "dead_probes"), parse_dead_probes(env[DEAD_PROBES_ENV]), SOURCE_ENV)
    for parts, value in parsed:
        layered.put(tuple(parts), value, SOURCE_SET)
    return validate_preset(layered.data, source=str(path)), layered


def read_preset_file(path: Path) -> dict[str, Any]:
    """The raw mapping of a preset file, read with the strict YAML rules; every failure is a PresetError."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PresetError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            "save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise PresetError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = strict_yaml.load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{path}: not valid YAML: {yaml_error_text(exc)}") from None
    if not isinstance(data, dict):
        raise PresetError(f"{path}: a preset is a YAML mapping, got {type(data).__name__}")
    return data


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}".split())


def validate_preset(data: Mapping[str, Any], source: str = "preset") -> Preset:
    """Validate a preset mapping; errors name every bad key as a dotted path."""
    try:
        return resolve(Preset.model_validate(data))
    except ValidationError as exc:
        raise PresetError(f"{source}: invalid preset:\n" + format_errors(exc)) from None
    except PresetError as exc:
        raise PresetError(f"{source}: {exc}") from None


def format_errors(exc: ValidationError, prefix: str = "") -> str:
    """One indented line per problem, each naming its key path (under `prefix`)."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"])
        path = prefix + path if path else path
        if err["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key (not part of a preset; check the spelling)")
        elif err["type"] == "missing":
            lines.append(f"  {path}: required key is missing")
        elif err["type"] in _STRICT_TYPE_HINTS:
            lines.append(f"  {path}: {_as_written(err['input'])} {_STRICT_TYPE_HINTS[err['type']]}")
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"  {path}: {message}" if path else f"  {message}")  # cross-field: names its keys
    return "\n".join(lines)


def _as_written(value: Any) -> str:
    """A refused value as the user wrote it in YAML (true, not Python's True)."""
    return (
        "true" if value is True else "false" if value is False else "null" if value is None else repr(value)
    )


# Strict types refuse what YAML 1.1 would have coerced; say what to write instead
_STRICT_TYPE_HINTS = {
    "int_type": "is not an integer: write plain decimal digits, e.g. 4 (yes/true/010 are not numbers)",
    "bool_type": "is not a boolean: write true or false (yes/no/on/off are not booleans)",
    "string_type": 'is not text: quote it, e.g. "2024"',
    "float_type": "is not a number: write digits, e.g. 30 or 0.5",
}


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `a.b=c` override to a raw preset mapping; the value is parsed as YAML."""
    parts, value = parse_override(override)
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def parse_override(override: str) -> tuple[list[str], Any]:
    """(key path, value) of one `a.b=c` override; the key must exist, the value is strict YAML."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise PresetError(
            f"--set {override!r}: expected KEY=VALUE with a dotted key, e.g. watchdog.dead_probes=2"
        )
    _check_override_path(parts, override)
    try:
        value = strict_yaml.load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise PresetError(f"--set {override!r}: value is not valid YAML: {yaml_error_text(exc)}") from None
    return parts, value


def _check_override_path(parts: list[str], override: str) -> None:
    model: type[BaseModel] | None = Preset
    for depth, part in enumerate(parts):
        if model is None:  # inside a free-form mapping (env, server_args): any key goes
            return
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:depth]) or "the top level"
            raise PresetError(
                f"--set {override!r}: unknown key {'.'.join(parts[: depth + 1])!r}; "
                f"keys under {where}: {', '.join(fields)}"
            )
        model, is_mapping = _nested_model(fields[part].annotation)
        if model is None and not is_mapping and depth < len(parts) - 1:
            raise PresetError(f"--set {override!r}: {'.'.join(parts[: depth + 1])!r} has no sub-keys")


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(model class, is a free mapping) for a field annotation, looking through Optional."""
    candidates = (
        get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    )
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, False
        if candidate is dict or get_origin(candidate) is dict:
            return None, True
    return None, False


# ---------------------------------------------------------------- resolution


def resolve(preset: Preset) -> Preset:
    """Fill every default that depends on other fields, so the YAML written to the run dir is explicit."""
    resolved = preset.model_copy(deep=True)
    default_name = f"miles-{resolved.name}"
    if resolved.scheduler.pbs.job_name is None:
        resolved.scheduler.pbs.job_name = default_name
    if resolved.scheduler.slurm.job_name is None:
        resolved.scheduler.slurm.job_name = default_name
    _resolve_slurm(resolved.scheduler.slurm, resolved.gpus_per_node)
    _resolve_pbs(resolved.scheduler.pbs, resolved.gpus_per_node)
    if resolved.engines.per_node is None:
        gpus, tp = resolved.gpus_per_node, resolved.engines.tp_size
        resolved.engines.per_node = max(1, gpus // tp) if resolved.engines.kind == "sglang" else 1
    resolved.env.setdefault("RAY_AUTH_MODE", "disabled")
    return Preset.model_validate(resolved.model_dump())


def _resolve_slurm(slurm: SlurmOptions, gpus_per_node: int) -> None:
    if slurm.gpus_per_node is None:
        slurm.gpus_per_node = gpus_per_node
    if slurm.exclusive is None:
        slurm.exclusive = slurm.gpus_per_node > 0  # GPU jobs own their nodes
    if slurm.mem is None and slurm.exclusive:
        slurm.mem = "0"  # all of each node's memory


def _resolve_pbs(pbs: PbsOptions, gpus_per_node: int) -> None:
    if pbs.whole_nodes:  # the queue defines the node: ABCI's `-l select=N` form
        pbs.ncpus = pbs.ngpus = pbs.place = None
    elif pbs.ngpus is None:
        pbs.ngpus = gpus_per_node


def preset_to_yaml(preset: Preset) -> str:
    """The resolved preset as YAML: every default filled, loadable again with `load_preset`."""
    return yaml.safe_dump(resolve(preset).model_dump(mode="json"), sort_keys=False, width=1000)


# ---------------------------------------------------------------- reference documentation


def reference_markdown() -> str:
    """docs/presets.md, generated from the models (`launcher presets doc > docs/presets.md`)."""
    lines = [
        "# Presets reference",
        "",
        "<!-- generated by `launcher presets doc > docs/presets.md`; a test keeps it up to date -->",
        "",
        "A preset is one YAML file (`presets/<name>.yaml`, or any path). Unknown keys are refused and",
        "every error names the key path. `launcher presets show NAME --resolved` prints the preset with",
        "every default filled; that resolved form is what the job hands to the runtime.",
        "",
        "Precedence, lowest first: the file, the user's defaults file, `GATEWAY_DEAD_PROBES` from the",
        "environment of `launcher`, `--set KEY=VALUE` overrides (dotted keys, YAML values:",
        "`--set engines.server_args.tp=2`, `--set 'driver.command=[python, app.py]'`). A `--set` of",
        "`watchdog.dead_probes` wins even over a malformed `GATEWAY_DEAD_PROBES` (otherwise refused,",
        "as is any count above 10000). `presets show NAME --resolved` writes each value's source (`preset`,",
        "`defaults file PATH`, `environment`, `--set`, or `default`) as a comment after it.",
        "",
        "## Strict values",
        "",
        "Presets, `--set` values and the defaults file are read as YAML 1.2, not PyYAML's YAML 1.1:",
        "",
        "- only `true`/`false` are booleans; `yes`, `no`, `on`, `off` are text, so `nodes: yes` is refused;",
        "- only plain decimals are integers: `010` (octal 8 in YAML 1.1) and `0x10` are refused where a",
        '  number is expected, and nothing is coerced (`nodes: true`, `gateway.port: "8080"` are refused);',
        "- `12:00:00` is text (YAML 1.1 reads base 60: 43200), so `walltime: 12:00:00` needs no quotes;",
        '- `env:` values become text: `OMP_NUM_THREADS: 4` is `"4"`, `FLAG: true` is `"true"`;',
        "- a PBS walltime is `[[HH:]MM:]SS` and a Slurm time `MM`, `HH:MM:SS` or `D-HH:MM:SS`, minutes and",
        "  seconds 0-59, days' hours 0-23 (`99:99:99`, `forever` are refused); a bare number is seconds",
        "  for PBS and minutes for Slurm, as the schedulers read them.",
        "",
        "Every problem is reported at once, each naming its key.",
        "",
        "## The defaults file",
        "",
        "Values you would otherwise pass on every submit live in `$MILES_DEFAULTS`, else",
        "`~/.config/miles/defaults.yaml` (`$XDG_CONFIG_HOME/miles/defaults.yaml`). It holds any key of the",
        "`scheduler:` section and the run directories `launcher runs --all` lists:",
        "",
        "```yaml",
        "scheduler:",
        "  pbs: {project: gaa50000, queue: rt_HF, walltime: 12:00:00}",
        "  slurm: {account: myacct, partition: gpu}",
        "runs_dirs: [/groups/gaa50000/me/runs]",
        "```",
        "",
        "It is applied over every preset and under `--set`, by the launcher only: the resolved preset",
        "written into the run directory already holds its values, so the job never reads it.",
        "",
    ]
    lines += [
        "## Shipped presets",
        "",
        "| name | nodes | train nodes | description |",
        "| --- | --- | --- | --- |",
    ]
    for name in list_presets():
        p = load_preset(name, env={})
        lines.append(f"| `{name}` | {p.nodes} | {p.train_nodes} | {p.description} |")
    lines.append("")
    _describe_model(Preset, "", lines)
    _describe_model(CatalogEntry, "catalog[].", lines)  # a list's entries: the walk above stops at lists
    return "\n".join(lines).rstrip() + "\n"


def _describe_model(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    lines += [f"## {title}", ""]
    if model.__doc__ and prefix:
        lines += [" ".join(model.__doc__.split()), ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested = []
    for name, field in model.model_fields.items():
        sub, _ = _nested_model(field.annotation)
        if sub is not None:
            nested.append((sub, f"{prefix}{name}."))
        default = "required" if field.is_required() else _default_text(field)
        kind = _type_text(field.annotation)
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{prefix}{name}` | {kind} | {default} | {description} |")
    lines.append("")
    for sub, sub_prefix in nested:
        _describe_model(sub, sub_prefix, lines)


def _default_text(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below"
    return (
        f"`{value!r}`" if value not in (None, "", [], {}) else ("none" if value is None else f"`{value!r}`")
    )


def _type_text(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("launcher.presets.", "")
    text = text.replace("launcher.catalog_preset.", "")
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    text = re.sub(r"Annotated\[(\w+), .*\]", r"\1", text)
    return f"`{text}`".replace("|", "\\|")
