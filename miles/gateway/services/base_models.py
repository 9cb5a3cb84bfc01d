"""The base models a server has, as its runtime's model cards say."""

from __future__ import annotations

from dataclasses import replace

from miles.gateway.errors import bad_request
from miles.gateway.services.model_ids import parse_model_id, variant_id
from miles.seam.runtime import ModelCard, Runtime


class BaseModels:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def cards(self) -> dict[str, ModelCard]:
        return {card.name: card for card in self._runtime.model_cards()}

    def advertised(self) -> list[ModelCard]:
        """What clients are told (capabilities, /v1/models): each base, and its variant at its full context
        (`<base>:peft:<max_context>`, the hosted lineup's form); any shorter variant is accepted too."""
        out = []
        for card in self.cards().values():
            out += [card, replace(card, name=variant_id(card.name, card.max_context))]
        return out

    def resolve(self, model: str, *, for_training: bool = False) -> tuple[ModelCard, int | None]:
        """The base card of `model` (a base id or a `:peft:` variant) and the variant's context, checked
        against the base's; user errors name what to send instead."""
        try:
            parsed = parse_model_id(model)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        card = self.card(parsed.base, for_training=for_training)
        if parsed.context is not None and parsed.context > card.max_context:
            raise bad_request(
                f"model {model!r}: {parsed.base} serves at most {card.max_context} tokens of context; "
                f"use {variant_id(parsed.base, card.max_context)!r} or a shorter variant"
            )
        return card, parsed.context

    def card(self, base_model: str, *, for_training: bool = False) -> ModelCard:
        """The card of `base_model`; a user error naming the known ones if there is none."""
        cards = self.cards()
        card = cards.get(base_model)
        if card is None:
            known = ", ".join(sorted(cards)) or "none"
            raise bad_request(f"unknown base_model {base_model!r}; this server has: {known}")
        if for_training and not card.trainable:
            raise bad_request(f"base_model {base_model!r} is served for sampling only")
        return card
