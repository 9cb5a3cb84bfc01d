"""Checks run on the submitting machine before a job is queued: what would otherwise fail only after the
allocation is granted (and the nodes have been held while the job waited in the queue)."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.presets import Preset

IMPLEMENTED_BACKENDS = ("transformers",)


def backend_problem(preset: Preset) -> str | None:
    backend = preset.model.backend
    if backend in IMPLEMENTED_BACKENDS:
        return None
    return (
        f"model.backend: {backend!r} is not implemented yet; use --set model.backend=transformers "
        "(it keeps a full model copy on every trainer rank, so the model must fit one GPU's share)"
    )


def model_problem(preset: Preset, env: Mapping[str, str]) -> str | None:
    """The model must resolve here as it will on the head node: a directory, or a cached hub name.

    The preset's own env (HF_HOME / HF_HUB_CACHE) wins over the submitting shell's, as in the job.
    """
    from miles.models.source import ModelNotFound, resolve_model_path

    if preset.model.init != "pretrained" or not preset.model.path:
        return None
    try:
        resolve_model_path(preset.model.path, {**env, **preset.env})
    except ModelNotFound as exc:
        return str(exc)
    return None


def submit_problems(preset: Preset, env: Mapping[str, str]) -> list[str]:
    """Every reason this preset's job would fail at bring-up, each naming the key and the fix."""
    return [p for p in (backend_problem(preset), model_problem(preset, env)) if p]
