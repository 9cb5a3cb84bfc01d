"""Checks run on the submitting machine before a job is queued: what would otherwise fail only after the
allocation is granted (and the nodes have been held while the job waited in the queue)."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.schedulers.pbs import project_problems
from miles.contract.engine_args import cpu_engine_parser, server_arg_flags
from miles.contract.layout import model_problems
from miles.contract.model_source import ModelNotFound, resolve_model_path
from miles.contract.preset import Preset
from miles.contract.shape import ModelShape


def model_problem(preset: Preset, env: Mapping[str, str]) -> str | None:
    """The model must resolve here as it will on the head node: a directory, or a cached hub name.

    The preset's own env (HF_HOME / HF_HUB_CACHE) wins over the submitting shell's, as in the job.
    """

    if preset.model.init != "pretrained" or not preset.model.path:
        return None
    try:
        resolve_model_path(preset.model.path, {**env, **preset.env})
    except ModelNotFound as exc:
        return str(exc)
    return None


def parallel_model_problems(preset: Preset, env: Mapping[str, str]) -> list[str]:
    """model.parallel against the model's heads, KV heads, layers and vocabulary, read from its config.json.

    Only where the model resolves here (a directory, or a cached hub name; model_problem reports the rest):
    otherwise, and for init: tiny, the backend runs the same checks when the job starts."""

    model = preset.model
    if model.backend != "megatron" or model.init != "pretrained" or not model.path:
        return []
    try:
        directory = resolve_model_path(model.path, {**env, **preset.env}).directory
        shape = ModelShape.from_model_dir(directory)
    except ModelNotFound:
        return []
    except (ValueError, KeyError) as exc:
        return [f"model.path: {model.path}: {exc}"]
    return model_problems(model.parallel, shape, model.max_context)


def engine_args_problem(preset: Preset) -> str | None:
    """The CPU engine takes only its own flags: SGLang server args left in a preset switched to the CPU
    engine would stop every engine at start."""
    if preset.engines.kind != "cpu" or not preset.engines.server_args:
        return None

    flags = server_arg_flags(preset.engines.server_args)
    _, unknown = cpu_engine_parser().parse_known_args(["--model-path", ".", "--port", "1", *flags])
    refused = [arg.split("=")[0] for arg in unknown if arg.startswith("--")]
    if not refused:
        return None
    return (
        f"engines.server_args: the CPU engine (engines.kind: cpu) does not take {', '.join(refused)}; "
        "drop them (--set 'engines.server_args={}') or run SGLang (engines.kind: sglang)"
    )


def submit_problems(preset: Preset, env: Mapping[str, str], scheduler: str | None = None) -> list[str]:
    """Every reason this preset's job would fail at bring-up (or `scheduler` would refuse it), each naming
    the key and the fix."""
    checks = (model_problem(preset, env), engine_args_problem(preset))
    problems = [p for p in checks if p] + parallel_model_problems(preset, env)
    if scheduler == "pbs":
        pbs = preset.scheduler.pbs
        problems += project_problems(pbs.project, pbs.project_required)
    return problems
