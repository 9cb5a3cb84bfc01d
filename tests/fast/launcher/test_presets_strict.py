"""Strict preset input: no YAML 1.1 coercions, strict integers, range-checked times, env values as text,
--set over a bad GATEWAY_DEAD_PROBES, and every cross-field problem reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.presets import load_preset
from miles.contract.preset import PresetError
from miles.contract.preset.gateway import MAX_DEAD_PROBES

MINIMAL = "name: t\nmodel: {name: m, init: tiny}\nengines: {kind: cpu}\n"


def preset_text(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL + extra)
    return str(path)


@pytest.mark.parametrize(
    ("line", "key", "shown"),
    [
        ("nodes: true", "nodes", "true"),
        ("nodes: yes", "nodes", "'yes'"),
        ("nodes: 010", "nodes", "'010'"),
        ("nodes: 0x10", "nodes", "'0x10'"),
        ("nodes: 2.0", "nodes", "2.0"),
        ('nodes: "2"', "nodes", "'2'"),
        ("gateway: {port: true}", "gateway.port", "true"),
        ("ray: {num_cpus: on}", "ray.num_cpus", "'on'"),
        ("scheduler: {pbs: {whole_nodes: yes}}", "scheduler.pbs.whole_nodes", "'yes'"),
    ],
)
def test_yaml_1_1_coercions_are_refused(tmp_path: Path, line: str, key: str, shown: str) -> None:
    with pytest.raises(PresetError) as caught:
        load_preset(preset_text(tmp_path, line + "\n"), env={})
    assert f"{key}: {shown} is not" in str(caught.value)


@pytest.mark.parametrize("override", ["nodes=yes", "nodes=true", "nodes=010", "gateway.port=true"])
def test_set_values_are_just_as_strict(override: str) -> None:
    with pytest.raises(PresetError, match="is not an integer"):
        load_preset("tiny-cpu", [override], env={})


def test_plain_integers_and_booleans_still_load(tmp_path: Path) -> None:
    text = "nodes: 1\ngateway: {port: 8080}\nscheduler: {pbs: {whole_nodes: true}}\n"
    preset = load_preset(preset_text(tmp_path, text), ["ray.num_cpus=4"], env={})
    assert (preset.nodes, preset.gateway.port, preset.ray.num_cpus) == (1, 8080, 4)
    assert preset.scheduler.pbs.whole_nodes is True


def test_unquoted_times_are_times(tmp_path: Path) -> None:
    text = "scheduler: {pbs: {walltime: 12:00:00}, slurm: {time: 1-12:00:00}}\n"
    preset = load_preset(preset_text(tmp_path, text), env={})
    assert preset.scheduler.pbs.walltime == "12:00:00"  # not YAML 1.1's base-60 integer 43200
    assert preset.scheduler.slurm.time == "1-12:00:00"
    again = load_preset("tiny-cpu", ["scheduler.pbs.walltime=168:00:00", "scheduler.slurm.time=90"], env={})
    assert (again.scheduler.pbs.walltime, again.scheduler.slurm.time) == ("168:00:00", "90")


def test_numbers_are_in_the_schedulers_own_units(tmp_path: Path) -> None:
    text = "scheduler: {pbs: {walltime: 5400}, slurm: {time: 90}}\n"
    preset = load_preset(preset_text(tmp_path, text), env={})
    assert preset.scheduler.pbs.walltime == "01:30:00"  # PBS: seconds
    assert preset.scheduler.slurm.time == "90"  # Slurm: minutes


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("pbs.walltime", "99:99:99", "minutes must be 0-59"),
        ("pbs.walltime", "10:00:60", "seconds must be 0-59"),
        ("pbs.walltime", "forever", "is not a walltime"),
        ("pbs.walltime", "00:00:00", "zero walltime"),
        ("slurm.time", "99:99:99", "minutes must be 0-59"),
        ("slurm.time", "2-24:00:00", "hours after the days must be 0-23"),
        ("slurm.time", "30:75", "seconds must be 0-59"),
        ("slurm.time", "forever", "is not a Slurm time"),
        ("slurm.time", "UNLIMITED", "is not a Slurm time"),
        ("slurm.time", "true", "is not a Slurm time"),
    ],
)
def test_out_of_range_times_are_refused(key: str, value: str, message: str) -> None:
    with pytest.raises(PresetError, match=message):
        load_preset("tiny-cpu", [f"scheduler.{key}={value}"], env={})


def test_env_values_become_text(tmp_path: Path) -> None:
    text = "env: {OMP_NUM_THREADS: 4, DEBUG: true, RATIO: 0.5, EMPTY: }\nengines: {kind: cpu, env: {N: 2}}\n"
    preset = load_preset(preset_text(tmp_path, text), ["env.LATE=7"], env={})
    assert preset.env["OMP_NUM_THREADS"] == "4" and preset.env["DEBUG"] == "true"
    assert (preset.env["RATIO"], preset.env["EMPTY"], preset.env["LATE"]) == ("0.5", "", "7")
    assert preset.engines.env == {"N": "2"}
    with pytest.raises(PresetError, match="an environment value is text"):
        load_preset("tiny-cpu", ["env.BAD=[1, 2]"], env={})


def test_set_wins_over_a_bad_dead_probes_environment() -> None:
    bad = {"GATEWAY_DEAD_PROBES": "lots"}
    with pytest.raises(PresetError, match="GATEWAY_DEAD_PROBES"):
        load_preset("tiny-cpu", env=bad)
    assert load_preset("tiny-cpu", ["watchdog.dead_probes=2"], env=bad).watchdog.dead_probes == 2
    assert load_preset("tiny-cpu", ["watchdog={dead_probes: 5}"], env=bad).watchdog.dead_probes == 5


@pytest.mark.parametrize("value", ["99999999999999999999", str(MAX_DEAD_PROBES + 1)])
def test_huge_dead_probe_counts_are_refused(value: str) -> None:
    with pytest.raises(PresetError, match=f"at most {MAX_DEAD_PROBES}"):
        load_preset("tiny-cpu", env={"GATEWAY_DEAD_PROBES": value})
    with pytest.raises(PresetError, match=r"watchdog\.dead_probes"):
        load_preset("tiny-cpu", [f"watchdog.dead_probes={value}"], env={})
    top = load_preset("tiny-cpu", env={"GATEWAY_DEAD_PROBES": str(MAX_DEAD_PROBES)})
    assert top.watchdog.dead_probes == MAX_DEAD_PROBES


def test_cross_field_problems_come_all_at_once() -> None:
    overrides = [
        "nodes=2",
        "train_nodes=2",
        "model.init=pretrained",
        "ray.node_port_base=65530",
    ]
    with pytest.raises(PresetError) as caught:
        load_preset("tiny-cpu", overrides, env={})
    text = str(caught.value)
    assert "train_nodes: 2 must be < nodes" in text
    assert "model.path: required" in text
    assert "ray.node_port_base" in text


def test_port_plan_limits_say_how_to_raise_them() -> None:
    with pytest.raises(PresetError) as caught:
        load_preset("tiny-cpu", ["ray.node_port_base=65530"], env={})
    assert "lower it to at most 65525 for 1 nodes, or unset it" in str(caught.value)
    with pytest.raises(PresetError) as caught:
        load_preset("tiny-cpu", ["ray.worker_port_base=65500", "ray.worker_ports_per_node=100"], env={})
    assert "lower it to at most 65436" in str(caught.value)
    assert load_preset("tiny-cpu", ["ray.worker_port_base=65436", "ray.worker_ports_per_node=100"], env={})


def test_a_preset_file_that_is_not_utf8_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(MINIMAL.encode() + "description: caf\xe9\n".encode("latin-1"))
    with pytest.raises(
        PresetError, match=r"not UTF-8 text \(byte 0xe9 at offset \d+\): save the file as UTF-8"
    ):
        load_preset(str(path), env={})


def test_yaml_syntax_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(PresetError) as caught:
        load_preset(preset_text(tmp_path, "nodes: [1\n"), env={})
    assert "not valid YAML: line" in str(caught.value) and "\n" not in str(caught.value)


def test_port_pick_exhaustion_says_what_to_change() -> None:
    import random

    from miles.contract.ports import PortError, pick

    with pytest.raises(PortError, match=r"lower ray\.worker_ports_per_node, or pin the range"):
        pick([], {"W": 9}, set(), random.Random(0), free=lambda _: True, bounds=(20000, 20008))
    with pytest.raises(PortError, match=r"pin the job's ports in the preset \(ray\.gcs_port"):
        pick(["GCS"], {}, {20000}, random.Random(0), free=lambda _: True, bounds=(20000, 20001))


def test_text_that_looks_like_other_types_survives_the_resolved_preset(tmp_path: Path) -> None:
    """The job reads back the resolved preset the launcher wrote: text stays that text."""
    from miles.contract.preset import preset_to_yaml

    looks_like = [
        "1e-5",
        "1.5e3",
        "yes",
        "010",
        "12:00:00",
        "0x1F",
        "2024-01-01",
        "true",
        "null",
        "~",
        ".5e3",
    ]
    overrides = [f"env.V{i}={json_text(value)}" for i, value in enumerate(looks_like)]
    preset = load_preset("tiny-cpu", [*overrides, "env.NUM=1e-5"], env={})
    assert [preset.env[f"V{i}"] for i in range(len(looks_like))] == looks_like
    assert preset.env["NUM"] == "1e-5"  # unquoted: YAML 1.1 reads no number there either
    path = tmp_path / "resolved.yaml"
    path.write_text(preset_to_yaml(preset))
    assert load_preset(str(path), env={}) == preset


def json_text(value: str) -> str:
    import json

    return json.dumps(value)


def test_push_delta_is_refused_where_it_cannot_serve() -> None:
    """SGLang engines, colocated pushes and LoRA get a clear submit-time refusal, all at once."""
    assert load_preset("tiny-cpu", ["model.train_mode=full", "runtime.push_delta=true"], env={})
    with pytest.raises(PresetError) as caught:
        load_preset("tiny-cpu", ["runtime.push_delta=true"], env={})  # tiny-cpu trains LoRA
    assert "model.train_mode lora pushes its base once" in str(caught.value)
    with pytest.raises(PresetError) as caught:
        load_preset("qwen3-0.6b-colocated", ["runtime.push_delta=true"], env={})
    text = str(caught.value)
    assert "SGLang engines cannot apply a delta" in text
    assert "a colocated push hands the engines CUDA IPC handles" in text
