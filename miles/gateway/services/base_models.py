"""The base models a server has, as its runtime's model cards say."""

from __future__ import annotations

from miles.gateway.errors import bad_request
from miles.seam.runtime import ModelCard, Runtime


class BaseModels:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def cards(self) -> dict[str, ModelCard]:
        return {card.name: card for card in self._runtime.model_cards()}

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
