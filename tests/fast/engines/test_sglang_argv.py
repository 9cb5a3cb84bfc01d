"""The engine argv the job builds, parsed by SGLang 0.5.23's own parser (`ServerArgs.add_cli_args`, then
`ServerArgs.from_cli_args`, which runs SGLang's own checks) for every shipped preset and override kind.

Needs the `sglang` wheel (installed without its GPU stack: `make sglang-parser`); skipped without it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from launcher.presets import load_preset
from miles.driver.bringup import engine_config

server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang wheel not installed")

HOST, PORT, KEY = "10.0.0.2", 30017, "-k3y-starting-with-a-dash"


def parse(argv: list[str]) -> Any:
    """SGLang's own parse of what EngineProcess runs; an unknown or malformed flag fails here."""
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    return server_args.ServerArgs.from_cli_args(parser.parse_args(argv[3:]))


def job_argv(preset_name: str, model_dir: Path, overrides: list[str] = ()) -> tuple[Any, list[str]]:
    preset = load_preset(preset_name, overrides=list(overrides), env={})
    config = engine_config(preset, model_dir, api_key=KEY)
    return preset, config.command(HOST, PORT)


def check_common(args: Any, preset: Any, model_dir: Path) -> None:
    assert args.model_path == str(model_dir.resolve())
    assert (args.host, args.port, args.api_key) == (HOST, PORT, KEY)
    assert args.tp_size == preset.engines.tp_size
    assert args.skip_server_warmup and args.enable_metrics


def test_lora_preset(tiny_model_dir: Path) -> None:
    preset, argv = job_argv("qwen3-4b-lora", tiny_model_dir)
    args = parse(argv)
    check_common(args, preset, tiny_model_dir)
    assert args.enable_lora is True and args.max_lora_rank == preset.model.lora_rank == 32
    assert args.lora_target_modules == ["all"]
    assert args.max_loaded_loras == preset.runtime.max_loaded_adapters
    assert args.max_loras_per_batch == min(8, preset.runtime.max_loaded_adapters)
    assert args.mem_fraction_static == pytest.approx(0.8)  # the preset's server_args


def test_tp8_full_finetune_preset(tiny_model_dir: Path) -> None:
    preset, argv = job_argv("qwen3.8-27b-128k", tiny_model_dir)
    args = parse(argv)
    check_common(args, preset, tiny_model_dir)
    assert args.tp_size == 8 and args.context_length == 131072
    assert args.mem_fraction_static == pytest.approx(0.85)
    assert not args.enable_lora  # full fine-tuning: no adapters on the engines


def test_base_engine_of_the_cpu_preset_switched_to_sglang(tiny_model_dir: Path) -> None:
    preset, argv = job_argv("tiny-cpu", tiny_model_dir, ["engines.kind=sglang", "model.train_mode=full"])
    args = parse(argv)
    check_common(args, preset, tiny_model_dir)
    assert not args.enable_lora and args.max_loaded_loras is None


def test_server_args_overrides_of_every_value_kind(tiny_model_dir: Path) -> None:
    overrides = [
        "runtime.max_loaded_adapters=4",
        "engines.server_args={max_loras_per_batch: 2, chunked_prefill_size: -1, disable_radix_cache: true, "
        "lora_target_modules: [q_proj, v_proj], "
        "json_model_override_args: {rope_theta: 500000}, served_model_name: tiny}",
    ]
    preset, argv = job_argv("qwen3-4b-lora", tiny_model_dir, overrides)
    args = parse(argv)
    check_common(args, preset, tiny_model_dir)
    assert args.max_loras_per_batch == 2 and args.max_loaded_loras == 4
    assert args.chunked_prefill_size == -1  # a negative value stays a value
    assert args.disable_radix_cache is True
    assert sorted(args.lora_target_modules) == ["q_proj", "v_proj"]  # a list: one argv element per item
    assert args.json_model_override_args == '{"rope_theta": 500000}'  # a mapping: JSON, as SGLang reads it
    assert args.served_model_name == "tiny"
