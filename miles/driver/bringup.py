"""Bring-up of the job's services from a resolved preset, each registered for orderly teardown.

Order: Ray -> model directory -> one placement group (bundles head last) -> engine cells and the trainer
cell side by side -> initial weights on the engines -> the gateway. Every resource is pushed onto the
caller's AsyncExitStack the moment it exists, so a failure or a signal at any phase stops exactly what
was started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from miles.checkpoints.manager import CheckpointManager
from miles.cluster.placement import create_gpu_placement_group, ordered_bundles
from miles.cluster.ray_setup import alive_nodes, connect, head_node_ip
from miles.contract.engine_args import server_arg_flags
from miles.contract.model_source import ModelNotFound, ResolvedModel, resolve_model_path
from miles.contract.preset import Preset, engine_release_tags, lora_batch_window_ms, state_key_prefix
from miles.engines.config import EngineConfig
from miles.gateway.app import create_app
from miles.gateway.server import TlsFiles, embedded_gateway_server
from miles.gateway.settings import GatewaySettings
from miles.observability.metrics import job_metrics
from miles.runtime.colocation import ColocationPlan
from miles.runtime.layout import colocated_layout, driver_role_plan, plan_layout
from miles.runtime.metered import MeteredRuntime
from miles.runtime.model_cells import CellSettings, ModelCells, serve_model_cells, start_model_cells
from miles.runtime.model_config import model_arch
from miles.runtime.ray_runtime import RayRuntime
from miles.seam.runtime import ModelCard, Runtime, SupervisedRuntime
from miles.state import StateStore, open_state_store
from miles.train.cell import TrainerCell
from miles.weights.push import PushConfig, update_mode

log = logging.getLogger("miles.driver.serve")

ServedModel = tuple[str, int]  # a catalog model's (train mode, max LoRA rank), for its engines' flags

GATEWAY_START_TIMEOUT_S = 60.0
# Teardown calls into Ray are bounded: on scancel/walltime the job's Ray processes get SIGTERM together
# with the driver, and a call into a dying GCS would block the driver's exit for a minute.
RAY_TEARDOWN_TIMEOUT_S = 2.0


def bounded(fn: Callable[..., object], *args: object, timeout_s: float = RAY_TEARDOWN_TIMEOUT_S) -> Callable:
    """A stack callback running `fn(*args)` in a daemon thread, abandoned after `timeout_s`."""

    name = getattr(fn, "__name__", "call")

    async def run() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def target() -> None:
            try:
                fn(*args)
            except Exception as exc:
                log.warning("teardown: %s failed: %s", name, exc)
            finally:
                loop.call_soon_threadsafe(done.set)

        threading.Thread(
            target=target, name=f"teardown-{getattr(fn, '__name__', 'call')}", daemon=True
        ).start()
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            log.warning(
                "teardown: %s did not return within %.0f s; going on", getattr(fn, "__name__", fn), timeout_s
            )

    return run


def resolve_model_dir(preset: Preset, run_dir: Path) -> ResolvedModel:
    """The tiny model built into the run dir, a local directory, or a hub name found in the HF cache."""
    if preset.model.init == "tiny":
        from miles.models.tiny import build_tiny_model, tiny_spec

        target = run_dir / "model"
        if not (target / "config.json").is_file():
            build_tiny_model(target, tiny_spec(preset.model.init_shape))
        return ResolvedModel(target.resolve(), None)
    if not preset.model.path:
        raise SystemExit("model.path is required unless model.init is 'tiny'")
    try:
        return resolve_model_path(preset.model.path)
    except ModelNotFound as exc:  # checked at submit too, but on the submitting machine's view of the cache
        raise ModelNotFound(f"on the head node: {exc}") from None


def load_api_keys(preset: Preset, run_dir: Path):
    """The preset's key source, else a generated `tml-` key in RUN_DIR/api_key (mode 0600)."""
    from miles.gateway.auth import ApiKeys, generate_api_key

    source = preset.gateway.api_key
    if source is not None and source.file:
        return ApiKeys.from_file(source.file)
    if source is not None and source.env:
        return ApiKeys.from_env(source.env)
    key_file = run_dir / "api_key"
    if not key_file.is_file():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(generate_api_key() + "\n")
    return ApiKeys.from_file(key_file)


def engine_api_key(run_dir: Path) -> str:
    """A per-job key the engines require: only the driver (not anyone on the cluster network who reads
    cells.json) may load adapters, push weights or generate. Kept in RUN_DIR/engine_api_key (0600)."""
    key_file = run_dir / "engine_api_key"
    if not key_file.is_file():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
    return key_file.read_text().strip()


def sglang_lora_defaults(preset: Preset, serving: ServedModel | None = None) -> dict[str, object]:
    """SGLang serves adapters loaded at run time only when started for it: LoRA on, the largest rank the
    job accepts (model.lora_rank), every linear module, and room for the adapters the runtime keeps.
    `serving`: a catalog model's (train mode, max LoRA rank) instead of the preset's model:."""
    train_mode, lora_rank = serving or (preset.model.train_mode, preset.model.lora_rank)
    if preset.engines.kind != "sglang" or train_mode != "lora":
        return {}
    loaded = preset.runtime.max_loaded_adapters
    return {
        "enable_lora": True,
        "max_lora_rank": lora_rank,
        "lora_target_modules": "all",
        "max_loras_per_batch": min(8, loaded),
        "max_loaded_loras": loaded,
    }


def engine_config(
    preset: Preset,
    model_dir: Path,
    log_dir: Path | None = None,
    api_key: str | None = None,
    serving: ServedModel | None = None,
) -> EngineConfig:
    """The engine's launch settings; server args (LoRA defaults, then the preset's) become flags."""
    extra = server_arg_flags({**sglang_lora_defaults(preset, serving), **preset.engines.server_args})
    return EngineConfig(
        model_path=str(model_dir),
        kind=preset.engines.kind,
        weight_api=preset.runtime.weight_api,
        extra_args=tuple(extra),
        env={**preset.env, **preset.engines.env},
        gpus_per_engine=preset.engines.tp_size,
        startup_timeout_s=preset.runtime.engine_startup_timeout_s,
        log_dir=str(log_dir) if log_dir else None,
        api_key=api_key,
    )


def push_config(preset: Preset) -> PushConfig:
    # gloo moves CPU tensors (CPU engines, logical GPUs); real GPU engines take NCCL: same code path.
    backend = "gloo" if preset.engines.kind == "cpu" and not torch.cuda.is_available() else "nccl"
    config = PushConfig(
        bucket_bytes=int(preset.runtime.push_bucket_mb * (1 << 20)),
        backend=backend,
        bucket_gap_s=preset.runtime.push_bucket_gap_s,
        delta=preset.runtime.push_delta,
        ipc_copies_to_device=bool(preset.colocate.enabled and preset.colocate.trainer_offload),
    )
    return update_mode(config, preset.runtime.push_update)


def colocation_plan(preset: Preset) -> ColocationPlan | None:
    """What the engines release and the trainer offloads when they share GPUs; None for split roles."""
    if not preset.colocate.enabled:
        return None
    return ColocationPlan(
        engine_release=tuple(engine_release_tags(preset)),
        trainer_offload=tuple(preset.colocate.trainer_offload),
    )


def tokenizer_id(preset: Preset, model: ResolvedModel) -> str:
    """What the SDK hands to AutoTokenizer: the hub name where there is one, else the preset's name."""
    if preset.model.init == "tiny":
        return str(model.directory)
    return model.hub_name or preset.model.name


def model_card(preset: Preset, model: ResolvedModel) -> ModelCard:
    model_dir = model.directory
    return ModelCard(
        name=preset.model.name,
        max_context=preset.model.max_context,
        trainable=True,
        sampleable=True,
        train_mode=preset.model.train_mode,
        tokenizer_id=tokenizer_id(preset, model),
        tokenizer_path=str(model_dir),
        max_lora_rank=preset.model.lora_rank if preset.model.train_mode == "lora" else None,
        arch=model_arch(model_dir),
    )


def cell_settings(
    preset: Preset, model_dir: Path, run_dir: Path, serving: ServedModel | None = None
) -> CellSettings:
    """How the preset's model cells start (the resident model's, and each catalog instance's)."""
    return CellSettings(
        model_dir=model_dir,
        train_mode=serving[0] if serving else preset.model.train_mode,
        engine=engine_config(preset, model_dir, run_dir / "logs", engine_api_key(run_dir), serving),
        trainer_dtype=preset.runtime.trainer_dtype,
        max_batch_tokens=preset.runtime.max_batch_tokens,
        torch_threads=int(preset.env.get("OMP_NUM_THREADS", "1") or 1),
        log_dir=run_dir / "logs",
        backend=preset.model.backend,
        parallel=preset.model.parallel,
        trainer_channel=preset.runtime.trainer_channel,
        colocate=preset.colocate.enabled,
    )


async def start_cells(preset: Preset, model_dir: Path, timeline, stack) -> ModelCells:
    gpus = preset.nodes * preset.gpus_per_node
    pg = await create_gpu_placement_group(
        gpus, name="miles-job", timeout_s=preset.runtime.placement_timeout_s, nodes_expected=preset.nodes
    )
    stack.push_async_callback(bounded(remove_placement_group, pg))
    roles_file = os.environ.get("MILES_ROLES_FILE")  # the job script's plan: one source of truth
    ips = [node["NodeManagerAddress"] for node in alive_nodes()]
    roles = Path(roles_file) if roles_file else None
    plan = driver_role_plan(ips, head_node_ip(), preset.train_nodes, roles, colocated=preset.colocate.enabled)
    ordered = await ordered_bundles(pg, plan)
    if preset.colocate.enabled:  # every GPU trains and serves (docs/colocation.md)
        layout = colocated_layout(ordered, tp_size=preset.engines.tp_size)
    else:
        layout = plan_layout(
            ordered, plan=plan, engines_per_node=preset.engines.per_node or 1, tp_size=preset.engines.tp_size
        )
    trainer_ips = sorted({b.node_ip for b in layout.trainer})
    engine_ips = [group[0].node_ip for group in layout.engines]
    timeline.phase("placement", f"{gpus} bundles; trainer on {trainer_ips}; engines on {engine_ips}")

    settings = cell_settings(preset, model_dir, timeline.run_dir)
    timeline.phase("cells", f"{len(layout.engines)} engine(s), trainer of {len(layout.trainer)} rank(s)")
    cells = await start_model_cells(pg, layout, settings)
    stack.push_async_callback(cells.stop)
    write_cells_file(timeline.run_dir, cells.trainer_cell, cells.engines)
    return cells


def write_cells_file(run_dir: Path, trainer_cell: TrainerCell, engines: list) -> None:
    """RUN_DIR/cells.json: what runs where (operators; fault drills kill a rank by its pid)."""
    facts = {
        "trainer": [dict(info) for info in trainer_cell.ranks_info],
        "trainer_commands": trainer_cell.command_path,  # "channel", or "actor calls" where none could open
        "engines": [
            {"index": c.index, "url": c.client.base_url if c.client else None, "state": c.state.value}
            for c in engines
        ],
    }
    (run_dir / "cells.json").write_text(json.dumps(facts, indent=2) + "\n")


def gateway_tls(preset: Preset) -> TlsFiles | None:
    """The preset's certificate and key (validated together by the preset), or None for plain http."""
    gateway = preset.gateway
    if gateway.tls_certfile is None or gateway.tls_keyfile is None:
        return None
    return TlsFiles(str(Path(gateway.tls_certfile).expanduser()), str(Path(gateway.tls_keyfile).expanduser()))


async def start_gateway(
    preset: Preset, run_dir: Path, runtime: Runtime, stack, store: StateStore | None = None
) -> None:
    """`store`: one the caller opened (and closes) already, e.g. the catalog controller's."""
    if store is None:
        store = open_state_store(preset.runtime.state_url, key_prefix=state_key_prefix(preset))
        stack.push_async_callback(store.close)
    root = Path(preset.runtime.checkpoint_root or run_dir / "checkpoints").expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    app = create_app(
        MeteredRuntime(runtime),
        store,
        CheckpointManager(root, store),
        load_api_keys(preset, run_dir),
        GatewaySettings(
            max_body_bytes=preset.gateway.max_body_mb << 20,
            custom_loss_server_side=preset.gateway.custom_losses,
            otel_endpoint=preset.gateway.otel_endpoint,
        ),
    )
    # a job's port is claimed by its script (GATEWAY_PORT, put here by serve.py); outside a job (a harness
    # composing bring_up itself) none is set and the OS picks one, as asyncio does for port None
    port = preset.gateway.port if preset.gateway.port is not None else 0
    server = embedded_gateway_server(app, preset.gateway.host, port, gateway_tls(preset))
    serving = asyncio.create_task(server.serve())

    async def stop_gateway() -> None:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 15)

    stack.push_async_callback(stop_gateway)
    async with asyncio.timeout(GATEWAY_START_TIMEOUT_S):
        while not server.started:
            if serving.done():  # e.g. the port is taken: uvicorn exits (SystemExit) instead of serving
                raise RuntimeError(
                    f"gateway could not serve on {preset.gateway.host}:{preset.gateway.port} "
                    "(see the log above)"
                )
            await asyncio.sleep(0.05)


async def bring_up(
    preset: Preset,
    run_dir: Path,
    timeline,
    stack: contextlib.AsyncExitStack,
    after_connect: Callable[[], None] = lambda: None,
    before_cells: Callable[[], Awaitable[None]] | None = None,
) -> SupervisedRuntime:
    """`before_cells`: awaited once Ray is connected, before anything takes the GPUs (the self-test's
    cluster checks)."""
    timeline.phase("ray")
    # in a thread, so a signal while the GCS does not answer still cancels bring-up at once
    await asyncio.to_thread(connect, timeout_s=preset.runtime.ray_connect_timeout_s)
    after_connect()
    stack.push_async_callback(bounded(ray.shutdown))
    if before_cells is not None:
        await before_cells()
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
    job_metrics().nodes_expected.set(preset.nodes)
    job_metrics().nodes_alive.set(len(nodes))
    timeline.phase("model", f"Ray has {len(nodes)} node(s): {sorted(nodes)}; head {head_node_ip()}")
    if preset.catalog is not None:  # instances on demand (docs/catalog.md); no job-wide placement group
        from miles.driver.catalog import bring_up_catalog

        return await bring_up_catalog(preset, run_dir, timeline, stack)
    model = await asyncio.to_thread(resolve_model_dir, preset, run_dir)
    cells = await start_cells(preset, model.directory, timeline, stack)
    timeline.phase("weights", f"{preset.model.train_mode} fine-tuning: engines get their first weights")
    runtime = await serve_model_cells(
        model_card(preset, model),
        cells,
        push=push_config(preset),
        max_loaded_adapters=preset.runtime.max_loaded_adapters,
        lora_batch_window_s=lora_batch_window_ms(preset) / 1000,
        colocation=colocation_plan(preset),
    )
    if preset.elastic.enabled:
        await start_elastic_training(preset, runtime, model.directory, stack)
    timeline.phase("gateway", f"{preset.gateway.host}:{preset.gateway.port}")
    await start_gateway(preset, run_dir, runtime, stack)
    return runtime


def lane_backend_kwargs(preset: Preset) -> dict[str, Any]:
    """What a lane's backend is built with beyond the model: the core trainer's dtype and budget, and for
    megatron the backend and its parallel sizes (TP 1: the lanes' state is the core's, regathered)."""
    kwargs: dict[str, Any] = {
        "dtype": preset.runtime.trainer_dtype,
        "max_batch_tokens": preset.runtime.max_batch_tokens,
    }
    if preset.model.backend != "transformers":
        kwargs.update(backend=preset.model.backend, parallel=preset.model.parallel.model_dump())
    return kwargs


async def start_elastic_training(preset: Preset, runtime: RayRuntime, model_dir: Path, stack) -> None:
    """The elastic driver over the resident model's cells (docs/elastic.md); stopped before the cells."""
    from miles.driver.elastic import start_elastic

    driver = await start_elastic(
        preset.elastic,
        runtime,
        run=preset.name,
        model_path=str(model_dir),
        lane_kwargs=lane_backend_kwargs(preset),
        registry=job_metrics().registry,
    )
    stack.push_async_callback(driver.stop)
