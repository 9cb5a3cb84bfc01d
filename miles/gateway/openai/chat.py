"""Prompt building for the OpenAI routes: the base model's tokenizer and chat template."""

from __future__ import annotations

import functools
from typing import Any

from miles.gateway.errors import bad_request


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    if not messages:
        raise bad_request("messages must not be empty")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def text_prompt(tokenizer: Any, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        ids = tokenizer.encode(prompt[0], add_special_tokens=False)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)")
    if not ids:
        raise bad_request("the prompt is empty")
    return [int(t) for t in ids]
