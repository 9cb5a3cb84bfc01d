"""Sampling parameters (validated like SGLang's) and the pure token choice.

Logprobs: the reported logprob of a token is log_softmax of the model's raw logits (temperature 1, no top-k,
top-p or min-p), at the token that was actually sampled. RL importance sampling and Tinker's `sample` want
the unmodified policy's probabilities, which is also what the trainer computes from the same weights; a
logprob of the tempered/truncated distribution would not be comparable with the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Every key SGLang 0.5.23's sampling-params contract accepts; any other key is a schema violation.
KNOWN_KEYS = frozenset(
    [
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    ]
)
# Accepted keys whose non-default values this engine cannot honour: refused rather than silently ignored.
UNSUPPORTED_UNLESS_DEFAULT: dict[str, Any] = {
    "stop_regex": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "beam_width": None,
    "watermark": None,
    "choice": [],
}


class SamplingSchemaError(ValueError):
    """The body violates SGLang's schema (SGLang answers 400 with a plain-string `error`)."""


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def parse_sampling_params(raw: dict[str, Any] | None) -> SamplingConfig:
    """Validate like SGLang: unknown keys -> SamplingSchemaError; bad values -> ValueError with the fix."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise SamplingSchemaError(
            f"sampling_params has unknown field(s) {unknown}; allowed fields: {sorted(KNOWN_KEYS)}"
        )
    for key, default in UNSUPPORTED_UNLESS_DEFAULT.items():
        if raw.get(key, default) not in (default, None):
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by the CPU engine")
    stop = raw.get("stop") or ()
    cfg = SamplingConfig(
        max_new_tokens=int(raw["max_new_tokens"]) if raw.get("max_new_tokens") is not None else 128,
        temperature=float(raw.get("temperature", 1.0)),
        top_p=float(raw.get("top_p", 1.0)),
        top_k=int(raw.get("top_k", -1)),
        min_p=float(raw.get("min_p", 0.0)),
        min_new_tokens=int(raw.get("min_new_tokens", 0)),
        n=int(raw.get("n", 1)),
        stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
        stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids") or ()),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
        no_stop_trim=bool(raw.get("no_stop_trim", False)),
        seed=int(raw["sampling_seed"]) if raw.get("sampling_seed") is not None else None,
    )
    _check_ranges(cfg)
    return cfg


def _check_ranges(cfg: SamplingConfig) -> None:
    # Same bounds and wording spirit as SGLang's SamplingParams.verify().
    if cfg.temperature < 0.0:
        raise ValueError(f"temperature must be non-negative, got {cfg.temperature}.")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}.")
    if not 0.0 <= cfg.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {cfg.min_p}.")
    if cfg.top_k < 1 and cfg.top_k != -1:
        raise ValueError(f"top_k must be -1 (disable), or at least 1, got {cfg.top_k}.")
    if cfg.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {cfg.max_new_tokens}.")
    if not 0 <= cfg.min_new_tokens <= max(cfg.max_new_tokens, 0):
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens({cfg.max_new_tokens})], got {cfg.min_new_tokens}."
        )
    if cfg.n < 1:
        raise ValueError(f"n must be at least 1, got {cfg.n}.")


def make_generator(seed: int | None, device: torch.device | None = None) -> torch.Generator:
    """A request's generator, on the model's device so that a seeded row draws where its logits are (a GPU
    engine moves no vocabulary-wide rows to the CPU to sample them)."""
    gen = torch.Generator(device=device or torch.device("cpu"))
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> tuple[int, float]:
    """Pick the next token from 1-D `logits`; return (token id, its logprob under the raw distribution)."""
    logits = logits.float().cpu()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    token = int(torch.argmax(logits)) if cfg.greedy else int(_draw(logits[None], cfg, gen)[0])
    return token, float(raw_logprobs[token])


def choose_tokens(
    logits: torch.Tensor,
    cfgs: list[SamplingConfig],
    gens: list[torch.Generator | None],
    shared: torch.Generator | None,
) -> tuple[list[int], list[float]]:
    """`choose_token` for the rows of `logits` [B, vocab] (any device) at once: (token ids, raw logprobs).

    Rows of one sampling config share one softmax and truncation (row-wise, so a row's probabilities do
    not depend on its neighbours); greedy rows take one argmax. A row with its own generator (a seeded
    request) then draws alone from it, as `choose_token` would, so its tokens do not depend on the rows it
    is batched with; unseeded rows draw in one call from `shared` (None: the device's default generator).
    """
    logits = logits.float()
    tokens = torch.empty(len(cfgs), dtype=torch.long, device=logits.device)
    for rows, cfg in _config_groups(cfgs):
        index = torch.tensor(rows, device=logits.device)
        if cfg.greedy:
            tokens[index] = torch.argmax(logits[index], dim=-1)
        else:
            tokens[index] = _draw_rows(_probs(logits[index], cfg), [gens[r] for r in rows], shared)
    raw_logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), raw_logprobs.tolist()


def _config_groups(cfgs: list[SamplingConfig]) -> list[tuple[list[int], SamplingConfig]]:
    """Row indices (in row order) per distinct sampling knobs; all greedy rows form one group."""
    groups: dict[Any, tuple[list[int], SamplingConfig]] = {}
    for row, cfg in enumerate(cfgs):
        key = "greedy" if cfg.greedy else (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
        groups.setdefault(key, ([], cfg))[0].append(row)
    return list(groups.values())


def _draw_rows(
    probs: torch.Tensor, gens: list[torch.Generator | None], shared: torch.Generator | None
) -> torch.Tensor:
    """One token per row of `probs`. Rows with a generator draw alone, in row order (the n samples of a
    request share one generator: a fixed order keeps them reproducible); the others in one call."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    rest = []
    for i, gen in enumerate(gens):
        if gen is None:
            rest.append(i)
        else:
            draw = torch.multinomial(probs[i : i + 1].to(gen.device), 1, generator=gen)
            out[i] = draw[0, 0].to(probs.device)
    if rest:
        index = torch.tensor(rest, device=probs.device)
        out[index] = torch.multinomial(probs[index], 1, generator=shared)[:, 0]
    return out


def _draw(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` [B, vocab], all from `gen`."""
    return torch.multinomial(_probs(logits, cfg), 1, generator=gen)[:, 0]


def _probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Sampling probabilities of rows of `logits`: temperature, then top-k, top-p, min-p."""
    return _truncate(torch.softmax(logits / cfg.temperature, dim=-1), cfg)


def _truncate(probs: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p to rows of probabilities [..., vocab] (renormalised by
    multinomial)."""
    vocab = probs.shape[-1]
    if cfg.top_k > 0 and cfg.top_k < vocab:
        kth = torch.topk(probs, cfg.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        total = sorted_probs.sum(dim=-1, keepdim=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1) / total
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cumulative - sorted_probs / total) >= cfg.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if cfg.min_p > 0.0:
        floor = cfg.min_p * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return probs
