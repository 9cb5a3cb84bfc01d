"""Model ids with a context variant, as the hosted lineup names them: `<base>:peft:<context>` is the base
model served with a context of `<context>` tokens (pure). A plain base id has the base's own context."""

from __future__ import annotations

from dataclasses import dataclass

PEFT = ":peft:"


@dataclass(frozen=True)
class ModelId:
    base: str
    context: int | None = None  # None: the base model's own maximum


def parse_model_id(name: str) -> ModelId:
    """`base` or `base:peft:<context>`; ValueError saying what is wrong with a malformed variant."""
    if PEFT not in name:
        return ModelId(name)
    base, _, context = name.rpartition(PEFT)
    if not base or not context.isdigit() or int(context) < 1:
        raise ValueError(
            f"model id {name!r}: a variant is '<base model>{PEFT}<context tokens>', e.g. 'M{PEFT}32768'"
        )
    return ModelId(base, int(context))


def variant_id(base: str, context: int | None) -> str:
    return base if context is None else f"{base}{PEFT}{context}"
