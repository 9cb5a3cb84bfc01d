"""Pure parts of the driver's bring-up: which bundles train/serve, engine argv, API keys, push config."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from launcher.presets import load_preset
from miles.cluster.ordering import BundleLocation, sort_bundles_by_plan
from miles.contract.roles import Node, RolePlan, plan_from_ips, plan_roles
from miles.driver.bringup import engine_config, load_api_keys, push_config
from miles.runtime.layout import LayoutError, colocated_layout, driver_role_plan, plan_layout


def bundles(spec: dict[str, int]) -> list[BundleLocation]:
    """Bundles already ordered head last: {ip: gpus}, in the given node order."""
    out, index = [], 0
    for ip, gpus in spec.items():
        for gpu in range(gpus):
            out.append(BundleLocation(index, ip, gpu, node_id=ip))
            index += 1
    return out


def planned(spec: dict[str, int], train_nodes: int = 1) -> tuple[list[BundleLocation], RolePlan]:
    """Bundles of `spec` ({ip: gpus}, the last ip is the head) in the order of their role plan."""
    ips = list(spec)
    plan = plan_from_ips(ips, ips[-1], train_nodes if len(ips) > 1 else 1)
    return sort_bundles_by_plan(bundles(spec), plan), plan


def test_multi_node_trainer_takes_whole_nodes_and_engines_their_first_gpus() -> None:
    ordered, plan = planned({"10.0.0.1": 8, "10.0.0.2": 8, "10.0.0.9": 8})  # .9 is the head (last)
    layout = plan_layout(ordered, plan=plan, engines_per_node=1, tp_size=8)
    assert {b.node_ip for b in layout.trainer} == {"10.0.0.1"} and len(layout.trainer) == 8
    assert {e[0].node_ip for e in layout.engines} == {"10.0.0.2", "10.0.0.9"}
    assert {b.node_ip for e in layout.engines for b in e} == {"10.0.0.2", "10.0.0.9"}
    assert all(len(e) == 8 for e in layout.engines)


def test_cpu_engines_use_one_bundle_per_engine_node() -> None:
    ordered, plan = planned({"127.0.0.2": 2, "127.0.0.3": 2, "127.0.0.4": 2})
    layout = plan_layout(ordered, plan=plan, engines_per_node=1, tp_size=1)
    assert len(layout.trainer) == 2 and [len(e) for e in layout.engines] == [1, 1]
    assert {b.node_ip for b in layout.trainer} == {"127.0.0.2"}
    assert [e[0].node_ip for e in layout.engines] == ["127.0.0.3", "127.0.0.4"]  # the head .4 last


def test_one_node_holds_trainer_and_engines() -> None:
    ordered, plan = planned({"127.0.0.2": 4})
    layout = plan_layout(ordered, plan=plan, engines_per_node=1, tp_size=2)
    assert [b.gpu_id for b in layout.trainer] == [0, 1]
    assert [[b.gpu_id for b in e] for e in layout.engines] == [[2, 3]]


def test_colocated_layout_pairs_trainer_rank_i_with_engine_i_on_one_gpu() -> None:
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.9"]  # .9 is the head: its GPUs come last
    plan = plan_from_ips(ips, "10.0.0.9", 3, colocated=True)
    ordered = sort_bundles_by_plan(bundles({ip: 2 for ip in ips}), plan)
    layout = colocated_layout(ordered, tp_size=1)
    assert layout.trainer == ordered  # every bundle trains, in plan order
    assert [e[0] for e in layout.engines] == ordered  # engine i on rank i's bundle (the IPC push's pairing)
    assert layout.trainer[-1].node_ip == "10.0.0.9"
    wide = colocated_layout(ordered, tp_size=2)
    assert [[b.gpu_id for b in e] for e in wide.engines] == [[0, 1]] * 3
    with pytest.raises(LayoutError, match=r"not a multiple of engines\.tp_size 4"):
        colocated_layout(ordered, tp_size=4)


def test_driver_role_plan_without_roles_file_plans_every_node_colocated() -> None:
    plan = driver_role_plan(["127.0.0.3", "127.0.0.2"], "127.0.0.2", 2, None, colocated=True)
    assert len(plan.trainers) == 2
    with pytest.raises(LayoutError, match="no role plan"):
        driver_role_plan(["127.0.0.3", "127.0.0.2"], "127.0.0.2", 2, None)  # split: needs engine nodes


@pytest.mark.parametrize(
    ("spec", "per_node", "tp", "message"),
    [({"a": 2}, 1, 2, "cannot hold 1 engine"), ({"10.0.0.1": 8, "10.0.0.2": 4}, 1, 8, "has 4 GPUs")],
)
def test_layouts_that_do_not_fit_say_why(spec, per_node, tp, message) -> None:
    plan = plan_from_ips(["10.0.0.1", "10.0.0.2"], "10.0.0.2", 1)
    ordered = bundles(spec) if len(spec) == 1 else sort_bundles_by_plan(bundles(spec), plan)
    with pytest.raises(LayoutError, match=message):
        plan_layout(ordered, plan=plan, engines_per_node=per_node, tp_size=tp)


def test_the_driver_takes_the_jobs_roles_tsv_as_its_plan(tmp_path: Path) -> None:
    written = plan_roles([Node("n1", "10.0.0.1"), Node("n2", "10.0.0.2"), Node("n3", "10.0.0.3")], "n2", 1)
    roles_file = tmp_path / "roles.tsv"
    roles_file.write_text(written.to_tsv())
    plan = driver_role_plan(["10.0.0.3", "10.0.0.1", "10.0.0.2"], "10.0.0.2", 1, roles_file)
    assert plan.rows() == written.rows()  # the job's plan, not a second one
    with pytest.raises(LayoutError, match=r"10\.0\.0\.8 are not in the job's role plan"):
        driver_role_plan(["10.0.0.1", "10.0.0.8"], "10.0.0.2", 1, roles_file)
    with pytest.raises(LayoutError, match="cannot read the job's role plan"):
        driver_role_plan(["10.0.0.1"], "10.0.0.1", 1, tmp_path / "missing.tsv")


def test_without_a_roles_tsv_the_driver_plans_with_the_same_function() -> None:
    plan = driver_role_plan(["127.0.0.4", "127.0.0.2", "127.0.0.3"], "127.0.0.2", 1, None)
    assert plan.rows() == plan_from_ips(["127.0.0.2", "127.0.0.3", "127.0.0.4"], "127.0.0.2", 1).rows()
    assert [p.node.ip for p in plan.ordered] == ["127.0.0.3", "127.0.0.4", "127.0.0.2"]
    with pytest.raises(LayoutError, match="head's node IP is unknown"):
        driver_role_plan(["127.0.0.2"], None, 1, None)


def test_engine_server_args_become_argv_elements(tmp_path: Path) -> None:
    preset = load_preset(
        "qwen3.8-27b-128k",  # full fine-tuning: no LoRA defaults are added
        overrides=["engines.server_args={mem_fraction_static: 0.8, enable_lora: true, skip: false}"],
        env={},
    )
    config = engine_config(preset, tmp_path, tmp_path / "logs")
    assert config.extra_args == ("--mem-fraction-static=0.8", "--enable-lora")
    assert config.log_dir == str(tmp_path / "logs") and config.kind == "sglang"
    argv = config.command("10.0.0.2", 30000)
    assert argv[argv.index("--tp-size") + 1] == str(preset.engines.tp_size)


def test_generated_api_key_is_private_and_stable(tmp_path: Path) -> None:
    preset = load_preset("tiny-cpu", env={})
    keys = load_api_keys(preset, tmp_path)
    key = (tmp_path / "api_key").read_text().strip()
    assert key.startswith("tml-") and keys.tenant_for(key) is not None
    assert stat.S_IMODE((tmp_path / "api_key").stat().st_mode) == 0o600
    again = load_api_keys(preset, tmp_path)  # a restarted driver keeps the key clients hold
    assert again.tenant_for(key) == keys.tenant_for(key)
    assert keys.tenant_for("tml-not-the-key-at-all") is None


def test_api_key_from_the_preset_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("tml-aaaaaaaaaaaaaaaa alice\ntml-bbbbbbbbbbbbbbbb bob\n")
    preset = load_preset("tiny-cpu", overrides=[f"gateway.api_key.file={key_file}"], env={})
    keys = load_api_keys(preset, tmp_path / "run")
    assert keys.tenant_for("tml-bbbbbbbbbbbbbbbb") == "bob"
    assert not (tmp_path / "run" / "api_key").exists()


@pytest.mark.parametrize(
    ("preset_name", "cuda_seen", "backend"),
    [
        ("tiny-cpu", False, "gloo"),
        ("tiny-cpu", True, "nccl"),
        ("qwen3-4b-lora", True, "nccl"),
        ("qwen3-4b-lora", False, "nccl"),  # a driver without a GPU of its own still drives GPU engines
    ],
)
def test_push_config_from_the_preset(
    monkeypatch: pytest.MonkeyPatch, preset_name: str, cuda_seen: bool, backend: str
) -> None:
    # The backend follows the devices the driver sees; the test decides what it sees, so it holds on a
    # laptop and on a CUDA node alike. gloo only where CPU engines meet a machine without CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_seen)
    preset = load_preset(
        preset_name, overrides=["runtime.push_bucket_mb=0.5", "runtime.push_bucket_gap_s=5"], env={}
    )
    config = push_config(preset)
    assert config.bucket_bytes == 512 * 1024 and config.bucket_gap_s == 5
    assert config.backend == backend


@pytest.mark.parametrize(("offload", "to_device"), [("[]", False), ("[optimizer]", True)])
def test_a_memory_tight_colocated_job_gives_push_copies_back_to_the_device(
    offload: str, to_device: bool
) -> None:
    preset = load_preset(
        "qwen3-0.6b-shape-colocated", overrides=[f"colocate.trainer_offload={offload}"], env={}
    )
    assert push_config(preset).ipc_copies_to_device is to_device
    assert push_config(load_preset("tiny-cpu", env={})).ipc_copies_to_device is False  # split roles


def test_engines_get_a_private_per_job_key(tmp_path: Path) -> None:
    from miles.driver.bringup import engine_api_key

    key = engine_api_key(tmp_path)
    assert len(key) >= 32 and engine_api_key(tmp_path) == key  # stable for a restarted driver
    assert stat.S_IMODE((tmp_path / "engine_api_key").stat().st_mode) == 0o600
    config = engine_config(load_preset("tiny-cpu", env={}), tmp_path, api_key=key)
    argv = config.command("127.0.0.2", 30000)
    assert f"--api-key={key}" in argv


def test_sglang_lora_jobs_start_engines_ready_for_runtime_adapters(tmp_path: Path) -> None:
    preset = load_preset("qwen3-4b-lora", env={})
    argv = engine_config(preset, tmp_path).command("10.0.0.2", 30000)
    assert "--enable-lora" in argv
    assert f"--max-lora-rank={preset.model.lora_rank}" in argv
    assert f"--max-loaded-loras={preset.runtime.max_loaded_adapters}" in argv
    assert "--lora-target-modules=all" in argv
    # a preset's own server_args win; full fine-tuning and CPU engines get none of it
    mine = load_preset("qwen3-4b-lora", overrides=["engines.server_args={max_loras_per_batch: 2}"], env={})
    argv = engine_config(mine, tmp_path).command("10.0.0.2", 30000)
    assert "--max-loras-per-batch=2" in argv
    assert "--enable-lora" not in engine_config(load_preset("tiny-cpu", env={}), tmp_path).command("h", 1)


def test_engine_argv_parses_even_when_values_start_with_a_dash(tmp_path: Path) -> None:
    """A generated key may start with "-" (it did, in CI): `--api-key -x` would fail the engine's start."""
    from miles.contract.engine_args import cpu_engine_parser

    config = engine_config(load_preset("tiny-cpu", env={}), tmp_path, api_key="-Ab3_key-starting-with-dash")
    argv = config.command("127.0.0.2", 30000)
    args = cpu_engine_parser().parse_args(argv[argv.index("--model-path") :])
    assert args.api_key == "-Ab3_key-starting-with-dash" and args.port == 30000
