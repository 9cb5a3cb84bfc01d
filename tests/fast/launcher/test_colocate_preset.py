"""Colocated jobs in the preset: `colocate:` resolved (engine release by train mode, one engine per GPU,
SGLang's memory saver), every check that refuses what colocation cannot do, `model.init_shape`, and the
two shipped colocated presets through a dry-run submit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher import api
from launcher.presets import load_preset
from miles.contract.preset import PresetError, engine_release_tags, preset_to_yaml, read_resolved
from miles.contract.preset.catalog import effective_catalog
from miles.contract.roles import read_roles_tsv

# A valid colocated preset to break one key at a time: one node, 2 logical GPUs, CPU engines.
BASE: dict[str, Any] = {
    "name": "c",
    "gpus_per_node": 2,
    "model": {"name": "m", "init": "tiny", "train_mode": "full"},
    "engines": {"kind": "cpu"},
    "colocate": {"enabled": True},
}


def write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def merged(patch: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


def load(tmp_path: Path, patch: dict[str, Any] | None = None, overrides: tuple[str, ...] = ()):
    return load_preset(write(tmp_path, merged(patch or {})), list(overrides), env={})


# ---- resolution -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train_mode", "release"), [("full", ["weights", "kv_cache"]), ("lora", ["kv_cache"])]
)
def test_engine_release_defaults_by_train_mode_and_is_written_out(
    tmp_path: Path, train_mode: str, release: list[str]
) -> None:
    preset = load(tmp_path, {"model": {"name": "m", "init": "tiny", "train_mode": train_mode}})
    assert engine_release_tags(preset) == release
    assert preset.colocate.engine_release == release  # explicit in the run directory's preset.yaml
    assert yaml.safe_load(preset_to_yaml(preset))["colocate"]["engine_release"] == release


def test_an_explicit_engine_release_wins_even_when_empty(tmp_path: Path) -> None:
    lora = {"model": {"name": "m", "init": "tiny", "train_mode": "lora"}}
    assert engine_release_tags(load(tmp_path, lora, ("colocate.engine_release=[]",))) == []
    assert engine_release_tags(load(tmp_path, overrides=("colocate.engine_release=[kv_cache]",))) == [
        "kv_cache"
    ]
    assert engine_release_tags(load(tmp_path, overrides=("colocate.engine_release=[]",))) == []


def test_a_split_job_releases_nothing_and_keeps_its_engine_defaults(tmp_path: Path) -> None:
    split = load(tmp_path, {"colocate": {"enabled": False}})
    assert engine_release_tags(split) == []
    assert split.colocate.engine_release is None and split.engines.per_node == 1  # cpu's split default
    assert "enable_memory_saver" not in split.engines.server_args


def test_colocated_runs_one_engine_per_gpu_whatever_the_kind(tmp_path: Path) -> None:
    assert load(tmp_path).engines.per_node == 2  # cpu kind: not the split default of 1
    sglang = load(tmp_path, {"engines": {"kind": "sglang"}, "gpus_per_node": 8})
    assert sglang.engines.per_node == 8


def test_sglang_engines_start_with_the_memory_saver(tmp_path: Path) -> None:
    sglang = load(tmp_path, {"engines": {"kind": "sglang", "server_args": {"mem_fraction_static": 0.3}}})
    assert sglang.engines.server_args == {"mem_fraction_static": 0.3, "enable_memory_saver": True}
    from miles.contract.engine_args import server_arg_flags

    assert "--enable-memory-saver" in server_arg_flags(sglang.engines.server_args)
    # a generating /health probe would make a release fail (engine busy) or hang on a released engine
    assert sglang.engines.env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    assert load(tmp_path).engines.env == {}  # the CPU engine's /health generates nothing


def test_the_memory_saver_goes_to_every_engine_kind_that_takes_it() -> None:
    """SGLang takes --enable-memory-saver; the CPU engine gets it as soon as its parser does (a colocated
    CPU engine then releases memory the same way), and never before (an unknown flag stops it at start)."""
    from miles.contract.engine_args import cpu_engine_parser, server_arg_flags
    from miles.contract.preset.colocate import MEMORY_SAVER_KINDS

    flags = server_arg_flags({"enable_memory_saver": True})
    assert flags == ["--enable-memory-saver"]
    _, unknown = cpu_engine_parser().parse_known_args(["--model-path", ".", "--port", "1", *flags])
    assert "sglang" in MEMORY_SAVER_KINDS
    assert ("cpu" in MEMORY_SAVER_KINDS) == (not unknown), (
        "cpu_engine_parser() and MEMORY_SAVER_KINDS disagree on --enable-memory-saver: add 'cpu' to "
        "miles.contract.preset.colocate.MEMORY_SAVER_KINDS once the CPU engine takes the flag"
    )


def test_the_resolved_colocated_preset_reads_back_unchanged(tmp_path: Path) -> None:
    preset = load(tmp_path, {"engines": {"kind": "sglang"}}, ("colocate.trainer_offload=[optimizer]",))
    path = tmp_path / "preset.yaml"
    path.write_text(preset_to_yaml(preset))
    again = read_resolved(path)
    assert again == preset
    assert (again.colocate.enabled, again.colocate.trainer_offload) == (True, ["optimizer"])


def test_two_colocated_nodes_both_train(tmp_path: Path) -> None:
    preset = load(tmp_path, {"nodes": 2, "train_nodes": 2})
    assert (preset.nodes, preset.train_nodes, preset.colocate.enabled) == (2, 2, True)


# ---- what colocation refuses, each naming the key and the fix ---------------------------------------------


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"model": {"name": "m", "init": "tiny", "train_mode": "full", "backend": "megatron"}},
            r"colocate\.enabled: model\.backend megatron cannot colocate yet .*set model\.backend "
            r"transformers or set colocate\.enabled false",
        ),
        (
            {"engines": {"kind": "cpu", "tp_size": 2}},
            r"engines\.tp_size: 2 with colocate\.enabled; .*one payload per trainer rank\): set it to 1",
        ),
        (
            {"elastic": {"enabled": True}, "runtime": {"lora_batch_window_ms": 0}},
            r"elastic\.enabled: a colocated job has no idle engine GPUs to lend .*set elastic\.enabled false",
        ),
        (
            {"nodes": 2, "train_nodes": 1},
            r"train_nodes: 1 with colocate\.enabled; every node of a colocated job trains and serves, so "
            r"set train_nodes to nodes \(2\)",
        ),
        (
            {"engines": {"kind": "cpu", "per_node": 1}},
            r"engines\.per_node: 1 with colocate\.enabled; a colocated job runs one engine per GPU, so "
            r"unset it or set it to gpus_per_node \(2\)",
        ),
        (
            {"catalog": [{"name": "m", "init": "tiny", "train_modes": ["full"]}]},
            r"catalog: a colocated job serves model: alone; drop catalog:",
        ),
        ({"gpus_per_node": 0}, r"gpus_per_node: colocate\.enabled needs at least 1 GPU per node"),
        (
            {"engines": {"kind": "sglang", "server_args": {"enable_memory_saver": False}}},
            r"engines\.server_args\.enable_memory_saver: colocated engines need it .*drop the key",
        ),
        (
            {"colocate": {"enabled": False, "trainer_offload": ["optimizer"]}},
            r"colocate\.trainer_offload: only a colocated job uses it; drop it or set colocate\.enabled true",
        ),
        (
            {"colocate": {"enabled": False, "engine_release": ["kv_cache"]}},
            r"colocate\.engine_release: only a colocated job uses it",
        ),
        (
            {"colocate": {"enabled": True, "trainer_offload": ["optimizer", "optimizer"]}},
            r"colocate\.trainer_offload: optimizer listed more than once",
        ),
        (
            {"colocate": {"enabled": True, "trainer_offload": ["weights"]}},
            r"colocate\.trainer_offload\.0: Input should be 'optimizer' or 'gradients'",
        ),
        (
            {"colocate": {"enabled": True, "engine_release": ["kv"]}},
            r"colocate\.engine_release\.0: Input should be 'weights' or 'kv_cache'",
        ),
        (  # nothing would bring the base weights back: LoRA pushes adapters only
            {"model": {"train_mode": "lora"}, "colocate": {"enabled": True, "engine_release": ["weights"]}},
            r"colocate\.engine_release: weights with model\.train_mode lora; .*use \[kv_cache\]",
        ),
    ],
)
def test_colocation_refuses_what_it_cannot_do(tmp_path: Path, patch: dict[str, Any], message: str) -> None:
    with pytest.raises(PresetError, match=message):
        load_preset(write(tmp_path, merged(patch)), env={})


def test_every_colocation_problem_is_reported_at_once(tmp_path: Path) -> None:
    data = merged({"nodes": 3, "train_nodes": 2, "engines": {"kind": "sglang", "tp_size": 2}})
    data["gpus_per_node"] = 8
    data["elastic"] = {"enabled": True}
    with pytest.raises(PresetError) as caught:
        load_preset(write(tmp_path, data), env={})
    text = str(caught.value)
    for key in ("engines.tp_size: 2 with colocate", "elastic.enabled: a colocated", "train_nodes: 2 with"):
        assert key in text, text
    # the split-role and elastic reserve messages would only confuse a colocated job
    assert "so at least the head serves engines" not in text and "min_rollout_gpus" not in text


def test_a_split_multi_node_job_still_keeps_an_engine_node_and_says_how_to_colocate(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match=r"train_nodes: 2 must be < nodes \(2\) .*colocate\.enabled true"):
        load(tmp_path, {"nodes": 2, "train_nodes": 2, "colocate": {"enabled": False}})


# ---- model.init_shape -------------------------------------------------------------------------------------


def test_init_shape_is_kept_with_init_tiny_and_carried_into_the_catalog(tmp_path: Path) -> None:
    model = {"name": "m", "init": "tiny", "train_mode": "full", "init_shape": "qwen3-0.6b"}
    preset = load(tmp_path, {"model": model})
    assert preset.model.init_shape == "qwen3-0.6b"
    assert [m.init_shape for m in effective_catalog(preset)] == ["qwen3-0.6b"]
    assert load(tmp_path).model.init_shape == "tiny"  # the default: the tiny test model as before


def test_init_shape_is_refused_with_a_pretrained_model(tmp_path: Path) -> None:
    model = {"name": "m", "init": "pretrained", "path": "/m", "init_shape": "qwen3-0.6b"}
    with pytest.raises(
        PresetError,
        match=r"model\.init_shape: qwen3-0\.6b is the shape of a model built from "
        r"scratch; .*drop init_shape or set model\.init tiny",
    ):
        load(tmp_path, {"model": model})
    with pytest.raises(PresetError, match=r"model\.init_shape: Input should be 'tiny' or 'qwen3-0\.6b'"):
        load(tmp_path, {"model": {"name": "m", "init": "tiny", "init_shape": "qwen3-4b"}})


def test_a_catalog_entry_refuses_init_shape_with_a_pretrained_model(tmp_path: Path) -> None:
    data = merged({"colocate": {"enabled": False}})
    data["model"] = {"name": "a", "init": "tiny"}
    data["catalog"] = [
        {"name": "a", "init": "tiny", "init_shape": "qwen3-0.6b"},
        {"name": "b", "path": "/b", "init_shape": "qwen3-0.6b"},
    ]
    with pytest.raises(PresetError, match=r"catalog\[1\] \(b\)\.init_shape: qwen3-0\.6b .*set init: tiny"):
        load_preset(write(tmp_path, data), env={})
    data["catalog"].pop()
    assert [m.init_shape for m in effective_catalog(load_preset(write(tmp_path, data), env={}))] == [
        "qwen3-0.6b"
    ]


# ---- the shipped colocated presets, as a user submits them -----------------------------------------------


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(base))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    return base


def test_the_colocated_qwen3_06b_preset(runs_dir: Path) -> None:
    preset = load_preset("qwen3-0.6b-colocated", env={})
    assert (preset.nodes, preset.train_nodes, preset.gpus_per_node) == (1, 1, 8)
    assert (preset.model.path, preset.model.train_mode, preset.runtime.trainer_dtype) == (
        "Qwen/Qwen3-0.6B",
        "full",
        "bfloat16",
    )
    assert (preset.engines.kind, preset.engines.tp_size, preset.engines.per_node) == ("sglang", 1, 8)
    assert preset.engines.server_args["enable_memory_saver"] is True
    assert 0 < preset.engines.server_args["mem_fraction_static"] <= 0.5  # room left for the trainer
    # 4.4 GiB of trainer state fits beside SGLang's fixed share: moving it would cost, not free (docs)
    assert preset.colocate.trainer_offload == []
    assert preset.runtime.push_bucket_mb * (1 << 20) > 1.1 * (1 << 30)  # the IPC push in one round trip
    assert engine_release_tags(preset) == ["kv_cache"]  # 1.1 GiB of weights stay: nobody needs it
    assert preset.scheduler.pbs.walltime == preset.scheduler.slurm.time == "04:00:00"
    # another node size is one --set away
    assert load_preset("qwen3-0.6b-colocated", ["gpus_per_node=4"], env={}).engines.per_node == 4


def test_the_colocated_qwen3_06b_shape_preset_is_the_same_job_on_one_gpu() -> None:
    real, shape = (
        load_preset("qwen3-0.6b-colocated", env={}),
        load_preset("qwen3-0.6b-shape-colocated", env={}),
    )
    assert (shape.model.init, shape.model.init_shape, shape.engines.kind) == ("tiny", "qwen3-0.6b", "cpu")
    assert (shape.gpus_per_node, shape.engines.per_node) == (1, 1)
    same = ("train_mode", "backend", "max_context")
    assert [getattr(shape.model, k) for k in same] == [getattr(real.model, k) for k in same]
    assert shape.colocate == real.colocate and shape.runtime.trainer_dtype == "bfloat16"


@pytest.mark.parametrize("name", ["qwen3-0.6b-colocated", "qwen3-0.6b-shape-colocated"])
@pytest.mark.parametrize("scheduler", ["local", "slurm", "pbs"])
def test_colocated_presets_pass_a_dry_run_submit(runs_dir: Path, name: str, scheduler: str) -> None:
    job = api.submit(name, scheduler=scheduler, dry_run=True)
    script = job.run.script.read_text()
    assert "  --colocated \\\n" in script  # the roles step plans every node as trainer and engine
    resolved = read_resolved(job.run.preset_file)
    assert resolved.colocate.enabled and resolved.colocate.engine_release == ["kv_cache"]
    # what a real submit would refuse here: only the site's own settings (a group, a hub download)
    for warning in job.warnings:
        assert "YOUR_ABCI_GROUP" in warning or "Hugging Face cache" in warning, warning
    if name == "qwen3-0.6b-shape-colocated" and scheduler != "pbs":
        assert job.warnings == []  # nothing to download, nothing to fill in


def test_a_split_preset_plans_roles_without_colocated(runs_dir: Path) -> None:
    assert "--colocated" not in api.submit("tiny-cpu", scheduler="slurm", dry_run=True).run.script.read_text()


def test_the_job_roles_step_plans_a_colocated_job(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from miles.job.roles import main as job_roles

    nodefile, tsv = tmp_path / "nodes", tmp_path / "roles.tsv"
    nodefile.write_text("node1\nnode2\nnode3\n")
    args = ["--nodefile", str(nodefile), "--head", "node1", "--ip-mode", "loopback-index", "--tsv", str(tsv)]
    result = CliRunner().invoke(job_roles, [*args, "--train-nodes", "3", "--colocated"])
    assert result.exit_code == 0, result.output
    assert [row[1:] for row in read_roles_tsv(tsv).rows()] == [
        ("node2", "127.0.0.3", "trainer,engine"),
        ("node3", "127.0.0.4", "trainer,engine"),
        ("node1", "127.0.0.2", "trainer,engine,head"),
    ]
    refused = CliRunner().invoke(job_roles, [*args, "--train-nodes", "2", "--colocated"])
    assert refused.exit_code != 0 and "train_nodes must be 3 for 3 nodes" in refused.output
