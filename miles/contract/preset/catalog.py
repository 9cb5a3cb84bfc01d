"""A preset's model catalog: the `catalog:` entries, their job defaults, validation, and the effective
catalog of any preset (one without `catalog:` serves its `model:` as a catalog of one resident model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from miles.contract.catalog import CatalogModel, TrainMode, fits
from miles.contract.preset.base import StrictModel
from miles.contract.preset.model import InitShape

if TYPE_CHECKING:  # the whole preset holds its catalog: annotations only
    from miles.contract.preset.preset import Preset


class CatalogEntry(StrictModel):
    """One model of `catalog:`: what a tenant may create handles for."""

    name: str = Field(description="Base model name clients use (tinker `base_model`).")
    path: str | None = Field(
        None, description="Hugging Face directory or hub name; required unless init is tiny."
    )
    init: Literal["pretrained", "tiny"] = Field("pretrained", description="`tiny`: built from config.")
    init_shape: InitShape = Field(
        "tiny",
        description="With init tiny, the architecture built: `tiny` or `qwen3-0.6b` (as model.init_shape).",
    )
    backend: Literal["transformers", "megatron"] = Field("transformers", description="Training backend.")
    train_modes: list[TrainMode] = Field(["lora"], description="Train modes tenants may ask for.")
    gpus_per_instance: int = Field(1, ge=1, description="GPUs of one instance, all on one node.")
    engines_per_instance: int = Field(1, ge=1, description="Engines in one instance.")
    lora_slots: int = Field(4, ge=1, description="LoRA tenants one instance holds at once.")
    max_lora_rank: int = Field(32, ge=1, description="Largest LoRA rank a tenant may ask for.")
    max_context: int = Field(4096, ge=16, description="Maximum sequence length in tokens.")
    resident: bool = Field(False, description="Started at bring-up and never released (reset per tenant).")
    idle_timeout_s: float | None = Field(
        None, gt=0, description="Business-idle seconds before a handle expires; none = catalog_defaults."
    )
    max_lifetime_s: float | None = Field(
        None, gt=0, description="A handle's maximum age in seconds; none = catalog_defaults."
    )


class CatalogDefaults(StrictModel):
    """Job defaults of the catalog's per-model lease settings."""

    idle_timeout_s: float = Field(
        1800.0, gt=0, description="Seconds without a training or sampling operation before a handle expires."
    )
    max_lifetime_s: float | None = Field(None, gt=0, description="A handle's maximum age; none = no limit.")


def effective_catalog(preset: Preset) -> list[CatalogModel]:
    """The catalog any preset serves: its `catalog:` entries, or its `model:` as one resident model."""
    defaults = preset.catalog_defaults
    if preset.catalog is None:
        m = preset.model
        return [
            CatalogModel(
                name=m.name,
                path=m.path,
                train_modes=(m.train_mode,),
                gpus_per_instance=max(1, preset.gpus_per_node),
                engines_per_instance=1,
                lora_slots=1 if m.train_mode == "full" else 1_000_000,  # today's job: no slot limit
                max_lora_rank=m.lora_rank,
                max_context=m.max_context,
                resident=True,
                idle_timeout_s=defaults.idle_timeout_s,
                max_lifetime_s=defaults.max_lifetime_s,
                init=m.init,
                backend=m.backend,
                init_shape=m.init_shape,
            )
        ]
    return [_catalog_model(entry, defaults) for entry in preset.catalog]


def _catalog_model(entry: CatalogEntry, defaults: CatalogDefaults) -> CatalogModel:
    return CatalogModel(
        name=entry.name,
        path=entry.path,
        train_modes=tuple(dict.fromkeys(entry.train_modes)),
        gpus_per_instance=entry.gpus_per_instance,
        engines_per_instance=entry.engines_per_instance,
        lora_slots=entry.lora_slots,
        max_lora_rank=entry.max_lora_rank,
        max_context=entry.max_context,
        resident=entry.resident,
        idle_timeout_s=entry.idle_timeout_s or defaults.idle_timeout_s,
        max_lifetime_s=entry.max_lifetime_s or defaults.max_lifetime_s,
        init=entry.init,
        backend=entry.backend,
        init_shape=entry.init_shape,
    )


def catalog_problems(p: Preset) -> list[str]:
    """Every problem of `catalog:` at once, each naming the field and the fix."""
    if p.catalog is None:
        return []
    if not p.catalog:
        return ["catalog: list at least one model, or drop catalog: to serve model: alone"]
    problems = []
    names = [e.name for e in p.catalog]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"catalog: model name {dup!r} appears {names.count(dup)} times; names must be unique")
    if p.model.name not in names:
        problems.append(f"model.name: {p.model.name!r} must be one of catalog's names ({', '.join(names)})")
    if p.gpus_per_node < 1:
        problems.append("gpus_per_node: a catalog needs at least 1 GPU per node (logical GPUs on CPU nodes)")
    for i, entry in enumerate(p.catalog):
        problems += _entry_problems(f"catalog[{i}] ({entry.name})", entry, p.gpus_per_node)
    residents = [e.gpus_per_instance for e in p.catalog if e.resident]
    if p.gpus_per_node >= 1 and not fits([p.gpus_per_node] * p.nodes, residents):
        problems.append(
            f"catalog: resident instances need {'+'.join(map(str, residents))} GPUs packed one instance per "
            f"node, more than {p.nodes} node(s) x {p.gpus_per_node} GPUs hold; make some resident: false"
        )
    return problems


def _entry_problems(where: str, entry: CatalogEntry, gpus_per_node: int) -> list[str]:
    problems = []
    if not entry.train_modes:
        problems.append(f"{where}.train_modes: list at least one of lora, full")
    if 1 <= gpus_per_node < entry.gpus_per_instance:
        problems.append(
            f"{where}.gpus_per_instance: {entry.gpus_per_instance} does not fit one node "
            f"(gpus_per_node {gpus_per_node}); an instance lives on one node, so lower it"
        )
    if entry.init == "pretrained" and not entry.path:
        problems.append(f"{where}.path: required when init is 'pretrained' (or set init: tiny)")
    if entry.init == "pretrained" and entry.init_shape != "tiny":
        problems.append(
            f"{where}.init_shape: {entry.init_shape} is the shape of a model built from scratch; init "
            "pretrained loads path as it is, so drop init_shape or set init: tiny"
        )
    return problems
