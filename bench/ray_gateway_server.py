"""The gateway over the production Ray runtime, for the SDK conformance suite: `python THIS --model-path
DIR --workdir DIR --port N --api-keys-file F [--fwdbwd-max-chunk-len N] [--long-poll-s S]
[--train-mode lora|full] [--set KEY=VALUE ...]`.

It composes the driver's own bring-up (miles.driver.bringup.bring_up: placement group, a trainer cell,
a CPU engine cell, RayRuntime, first weights) on a local Ray with two logical GPUs, the tiny-cpu preset
pointed at the test's model directory, and serves the gateway with the settings the conformance suite
needs (chunking, zstd, a request log) - which a job's driver does not take from its preset.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

import ray

from launcher.presets import load_preset
from miles.checkpoints.manager import CheckpointManager
from miles.contract import events
from miles.contract.preset import resolve
from miles.driver.bringup import bring_up
from miles.driver.serve import Timeline
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.server import run_event_loop, serve_gateway
from miles.gateway.settings import GatewaySettings
from miles.state import MemoryStateStore


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", required=True, type=Path)
    p.add_argument("--model-name", required=True)
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--api-keys-file", required=True, type=Path)
    p.add_argument("--long-poll-s", type=float, default=25.0)
    p.add_argument("--fwdbwd-max-chunk-len", type=int, default=None)
    p.add_argument("--train-mode", choices=("lora", "full"), default="lora")
    p.add_argument("--lora-batch-window-ms", type=float, default=None, help="default: the preset's")
    p.add_argument(
        "--no-trainer-channel", action="store_true", help="trainer commands as Ray actor calls only"
    )
    p.add_argument(
        "--set", action="append", default=[], dest="sets", metavar="KEY=VALUE", help="a preset override"
    )
    return p


async def _main(args: argparse.Namespace) -> None:
    overrides = [
        f"model.name={args.model_name}",
        "model.init=pretrained",
        f"model.path={args.model_path}",
        f"runtime.checkpoint_root={args.workdir / 'checkpoints'}",
        f"model.train_mode={args.train_mode}",
    ]
    if args.lora_batch_window_ms is not None:
        overrides.append(f"runtime.lora_batch_window_ms={args.lora_batch_window_ms}")
    if args.no_trainer_channel:
        overrides.append("runtime.trainer_channel=false")
    overrides += args.sets
    preset = resolve(load_preset("tiny-cpu", overrides, env={}))
    (args.workdir / "logs").mkdir(parents=True, exist_ok=True)
    events.configure(args.workdir)  # as the driver does: RUN_DIR/events.jsonl
    ray.init(
        num_cpus=4,
        num_gpus=preset.gpus_per_node,  # logical GPUs, as the job script's `ray start` advertises them
        namespace="miles",
        include_dashboard=False,
    )
    settings = GatewaySettings(
        long_poll_s=args.long_poll_s,
        fwdbwd_max_chunk_len=args.fwdbwd_max_chunk_len,
        proto_compress_fwdbwd=True,
        request_log_path=str(args.workdir / "requests.jsonl"),
    )
    async with contextlib.AsyncExitStack() as stack:
        runtime = await bring_up(preset, args.workdir, Timeline(args.workdir), stack)
        store = MemoryStateStore()
        checkpoints = CheckpointManager(args.workdir / "checkpoints", store)
        app = create_app(runtime, store, checkpoints, ApiKeys.from_file(args.api_keys_file), settings)
        await serve_gateway(app, "127.0.0.1", args.port)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_event_loop(_main(_parser().parse_args()))
