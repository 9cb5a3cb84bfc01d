"""Presets: shipped presets load, errors name the bad key, --set overrides, GATEWAY_DEAD_PROBES."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli import main
from launcher.presets import list_presets, load_preset
from miles.contract.preset import (
    PresetError,
    lora_batch_window_ms,
    parse_dead_probes,
    preset_to_yaml,
    state_key_prefix,
)
from miles.contract.preset.preset import DEFAULT_LORA_BATCH_WINDOW_MS

MINIMAL = {"name": "t", "model": {"name": "m", "init": "tiny"}, "engines": {"kind": "cpu"}}


def write_preset(tmp_path: Path, data: dict, name: str = "p.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


SHIPPED = [
    "tiny-cpu",
    "qwen3-4b-lora",
    "qwen3.8-27b-128k",
    "qwen3-0.6b-colocated",
    "qwen3-0.6b-shape-colocated",
]


def test_shipped_presets() -> None:
    assert set(SHIPPED) <= set(list_presets())
    big = load_preset("qwen3.8-27b-128k", env={})
    assert (big.nodes, big.train_nodes, big.gpus_per_node) == (10, 5, 8)
    assert (big.engines.kind, big.engines.tp_size, big.engines.per_node) == ("sglang", 8, 1)
    assert (big.model.max_context, big.model.train_mode, big.model.backend) == (131072, "full", "megatron")
    small = load_preset("qwen3-4b-lora", env={})
    assert (small.nodes, small.model.lora_rank, small.scheduler.pbs.queue) == (2, 32, "rt_HF")
    assert small.model.path == "Qwen/Qwen3-4B-Instruct-2507"
    tiny = load_preset("tiny-cpu", env={})
    assert (tiny.nodes, tiny.engines.kind, tiny.model.init) == (1, "cpu", "tiny")
    colocated = load_preset("qwen3-0.6b-colocated", env={})
    assert (colocated.colocate.enabled, colocated.gpus_per_node, colocated.engines.per_node) == (True, 8, 8)
    shape = load_preset("qwen3-0.6b-shape-colocated", env={})
    assert (shape.model.init_shape, shape.engines.kind, shape.gpus_per_node) == ("qwen3-0.6b", "cpu", 1)
    assert not (tiny.colocate.enabled or small.colocate.enabled or big.colocate.enabled)


@pytest.mark.parametrize("name", SHIPPED)
def test_resolved_yaml_fills_defaults_and_round_trips(tmp_path: Path, name: str) -> None:
    preset = load_preset(name, env={})
    text = preset_to_yaml(preset)
    data = yaml.safe_load(text)
    assert data["scheduler"]["slurm"]["job_name"] == f"miles-{name}"
    assert data["watchdog"]["dead_probes"] == 4 and data["watchdog"]["probe_interval_s"] > 0
    assert data["env"]["RAY_AUTH_MODE"] == "disabled"
    assert data["engines"]["per_node"] >= 1
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_preset(str(path), env={}) == preset


def test_defaults_of_a_minimal_preset(tmp_path: Path) -> None:
    preset = load_preset(write_preset(tmp_path, MINIMAL), env={})
    w = preset.watchdog
    assert (w.dead_probes, w.probe_interval_s, w.startup_probe_interval_s, w.startup_timeout_s) == (
        4,
        30,
        10,
        3600,
    )
    assert preset.gateway.api_key is None and preset.driver.command is None


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"engines": {"kind": "cpu", "colour": "red"}}, r"engines\.colour: unknown key"),
        ({"bogus": 1}, r"bogus: unknown key"),
        ({"scheduler": {"pbs": {"launch": "rsh"}}}, r"scheduler\.pbs\.launch: Input should be"),
        ({"nodes": 3, "train_nodes": 3}, r"train_nodes: 3 must be < nodes \(3\)"),
        ({"nodes": 1, "train_nodes": 2}, r"train_nodes: a 1-node job has train_nodes 1"),
        ({"gpus_per_node": 8, "engines": {"tp_size": 3}}, r"engines\.tp_size: 3 must divide gpus_per_node"),
        (
            {"gpus_per_node": 2, "engines": {"kind": "sglang", "tp_size": 4}},
            r"engines\.tp_size: 4 needs gpus_per_node >= 4",
        ),
        (
            {"model": {"name": "m", "init": "pretrained"}},
            r"model\.path: required when model\.init is 'pretrained'",
        ),
        ({"gateway": {"port": 70000}}, r"gateway\.port: Input should be less than or equal to 65535"),
        ({"gateway": {"api_key": {"file": "/k", "env": "K"}}}, r"gateway\.api_key: give exactly one"),
        ({"env": {"BAD NAME": "x"}}, r"env: 'BAD NAME' is not a valid environment variable name"),
        ({"ray": {"temp_dir": "/tmp/" + "x" * 40}}, r"ray\.temp_dir: must be an absolute path of at most 32"),
        ({"ray": {"node_ip": {"mode": "prefix"}}}, r"ray\.node_ip: mode 'prefix' needs 'prefix'"),
        ({"watchdog": {"dead_probes": "08"}}, r"watchdog\.dead_probes=.?'08'.? is not a plain"),
        ({"watchdog": {"dead_probes": -1}}, r"watchdog\.dead_probes: -1 is not a plain non-negative count"),
        ({"name": "a b"}, r"name: use letters"),
        ({"runtime": {"state_key_prefix": "a:b"}}, r"runtime\.state_key_prefix: use letters"),
        ({"engines": {"kind": "sglang"}}, r"engines\.tp_size: 1 needs gpus_per_node >= 1 \(is 0\)"),
    ],
)
def test_validation_errors_name_the_bad_key(tmp_path: Path, patch: dict, message: str) -> None:
    data = yaml.safe_load(yaml.safe_dump(MINIMAL))
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    with pytest.raises(PresetError, match=message):
        load_preset(write_preset(tmp_path, data), env={})


def test_state_key_prefix_defaults_to_the_preset_name_and_can_be_set_per_job(tmp_path: Path) -> None:
    default = load_preset(write_preset(tmp_path, MINIMAL), env={})
    assert state_key_prefix(default) == "miles-t"
    own = load_preset(write_preset(tmp_path, {**MINIMAL, "runtime": {"state_key_prefix": "alice-t"}}), env={})
    assert state_key_prefix(own) == "alice-t"


def test_lora_batch_window_has_a_default_and_can_be_set_per_job(tmp_path: Path) -> None:
    default = load_preset(write_preset(tmp_path, MINIMAL), env={})
    assert default.runtime.lora_batch_window_ms is None
    assert lora_batch_window_ms(default) == DEFAULT_LORA_BATCH_WINDOW_MS
    off = load_preset(write_preset(tmp_path, {**MINIMAL, "runtime": {"lora_batch_window_ms": 0}}), env={})
    assert lora_batch_window_ms(off) == 0.0


def test_unknown_preset_name_lists_the_shipped_ones() -> None:
    with pytest.raises(PresetError, match=r"unknown preset 'nope': use one of .*tiny-cpu"):
        load_preset("nope")
    with pytest.raises(PresetError, match="does not exist"):
        load_preset("/no/such/file.yaml")


def test_set_overrides_nested_lists_and_mappings() -> None:
    preset = load_preset(
        "qwen3-4b-lora",
        [
            "watchdog.dead_probes=2",
            "scheduler.pbs.project=gaa50000",
            "scheduler.slurm.extra_directives=[--exclusive, --constraint=h100]",
            "driver.command=[python, -m, http.server, '8000']",
            "env.NCCL_DEBUG=INFO",
            "engines.server_args.mem_fraction_static=0.7",
            "ray.node_ip.mode=prefix",
            "ray.node_ip.prefix=10.1.",
        ],
        env={},
    )
    assert preset.watchdog.dead_probes == 2
    assert preset.scheduler.pbs.project == "gaa50000"
    assert preset.scheduler.slurm.extra_directives == ["--exclusive", "--constraint=h100"]
    assert preset.driver.command == ["python", "-m", "http.server", "8000"]
    assert preset.env["NCCL_DEBUG"] == "INFO"
    assert preset.engines.server_args == {"mem_fraction_static": 0.7}
    assert (preset.ray.node_ip.mode, preset.ray.node_ip.prefix) == ("prefix", "10.1.")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("watchdog.dead_probs=2", r"unknown key 'watchdog\.dead_probs'; keys under watchdog: dead_probes"),
        ("nope=1", r"unknown key 'nope'; keys under the top level: name"),
        ("nodes.x=1", r"'nodes' has no sub-keys"),
        ("nodes", r"expected KEY=VALUE"),
        ("watchdog.dead_probes=08", r"watchdog\.dead_probes=.?'08'.? is not a plain"),
    ],
)
def test_bad_overrides_are_refused(override: str, message: str) -> None:
    with pytest.raises(PresetError, match=message):
        load_preset("tiny-cpu", [override], env={})


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("4", 4), ("12", 12), ("100", 100)])
def test_parse_dead_probes_accepts_plain_counts(text: str, value: int) -> None:
    assert parse_dead_probes(text) == value


@pytest.mark.parametrize(
    "text", ["08", "00", "-1", "+4", "4.0", " 4", "4 ", "four", "", "4\n", "٤", "1e3", "0x4"]
)
def test_parse_dead_probes_refuses_anything_else(text: str) -> None:
    with pytest.raises(PresetError, match=r"GATEWAY_DEAD_PROBES=.* is not a plain non-negative count"):
        parse_dead_probes(text)


def test_env_gateway_dead_probes_overrides_the_preset() -> None:
    assert load_preset("tiny-cpu", env={"GATEWAY_DEAD_PROBES": "0"}).watchdog.dead_probes == 0
    assert load_preset("tiny-cpu", env={"GATEWAY_DEAD_PROBES": "9"}).watchdog.dead_probes == 9
    # --set is the most explicit and wins over the environment
    assert (
        load_preset("tiny-cpu", ["watchdog.dead_probes=3"], {"GATEWAY_DEAD_PROBES": "9"}).watchdog.dead_probes
        == 3
    )


@pytest.mark.parametrize("text", ["08", "-1", "4.0", " 4", "four"])
def test_env_gateway_dead_probes_is_validated(text: str) -> None:
    with pytest.raises(PresetError, match=f"GATEWAY_DEAD_PROBES={text!r}"):
        load_preset("tiny-cpu", env={"GATEWAY_DEAD_PROBES": text})


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_DEAD_PROBES", "7")
    assert load_preset("tiny-cpu").watchdog.dead_probes == 7


# ---------------------------------------------------------------- CLI


def test_cli_presets_list_and_json() -> None:
    result = CliRunner().invoke(main, ["presets", "list", "--json"], env={"GATEWAY_DEAD_PROBES": None})
    assert result.exit_code == 0, result.output
    names = [p["name"] for p in json.loads(result.output)]
    assert names == list_presets()
    result = CliRunner().invoke(main, ["presets", "list"])
    assert result.exit_code == 0 and "qwen3.8-27b-128k" in result.output


def test_cli_presets_show_raw_resolved_and_json() -> None:
    runner = CliRunner(env={"GATEWAY_DEAD_PROBES": None})
    raw = runner.invoke(main, ["presets", "show", "tiny-cpu"])
    assert raw.exit_code == 0 and raw.output.startswith("# Runs anywhere")
    resolved = runner.invoke(main, ["presets", "show", "tiny-cpu", "--resolved"])
    assert yaml.safe_load(resolved.output)["scheduler"]["pbs"]["job_name"] == "miles-tiny-cpu"
    shown = runner.invoke(main, ["presets", "show", "tiny-cpu", "--json", "--set", "nodes=1"])
    assert json.loads(shown.output)["ray"]["node_ip"]["mode"] == "loopback-index"
    missing = runner.invoke(main, ["presets", "show", "nope"])
    assert missing.exit_code == 1 and "unknown preset 'nope'" in missing.output


def test_cli_presets_validate(tmp_path: Path) -> None:
    good = write_preset(tmp_path, MINIMAL, "good.yaml")
    result = CliRunner().invoke(main, ["presets", "validate", good, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["valid"] is True
    bad = write_preset(tmp_path, {**MINIMAL, "engines": {"kind": "gpu"}}, "bad.yaml")
    result = CliRunner().invoke(main, ["presets", "validate", bad])
    assert result.exit_code == 1
    assert "engines.kind: Input should be 'sglang' or 'cpu'" in result.output


def test_committed_presets_reference_is_up_to_date() -> None:
    from launcher.preset_reference import reference_markdown

    doc = Path(__file__).resolve().parents[3] / "docs" / "presets.md"
    assert doc.read_text() == reference_markdown(), "regenerate: launcher presets doc > docs/presets.md"
    assert "`watchdog.dead_probes`" in doc.read_text() and "loopback-index (TEST MODE)" in doc.read_text()


@pytest.mark.parametrize(
    ("override", "clash"),
    [
        ("ray.node_port_base=17000", "17001 (PBS Professional's pbs_comm)"),
        ("ray.node_port_base=14990", "15001 (PBS Professional's pbs_server)"),  # node 1's ports 15000-15005
        ("gateway.port=15002", "15002 (PBS Professional's pbs_mom)"),
        ("ray.gcs_port=6817", "6817 (slurmctld)"),
        ("ray.worker_port_base=16950", "17001 (PBS Professional's pbs_comm)"),
    ],
)
def test_fixed_ports_on_a_scheduler_daemons_port_are_refused(override: str, clash: str) -> None:
    with pytest.raises(PresetError, match=re.escape(clash)):
        load_preset("qwen3-4b-lora", [override], env={})


def test_fixed_ports_clear_of_the_daemons_are_accepted() -> None:
    preset = load_preset("qwen3-4b-lora", ["ray.node_port_base=17100", "gateway.port=15100"], env={})
    assert preset.ray.node_port_base == 17100
