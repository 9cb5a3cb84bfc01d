"""The self-test's client half: what a user's first RL step does, through the job's own gateway with the
real tinker SDK (blocking calls: the driver runs these in a thread while its loop serves the gateway).

`kl_sample_train_v1` is tinker-cookbook's rl_numerics_check quantity: over every sampled token, the mean of
the sampler's logprob minus the trainer's logprob of the same token (positive: the sampler is more sure).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PROMPT_TOKENS = 16
TRAIN_SEQUENCES = 4
TRAIN_TOKENS = 32
# Per-token sampler-trainer differences in bf16 have a spread near 1e-2 (measured on an H100, the 0.6B
# shape): the mean of n tokens is known to 1e-2/sqrt(n), so 64 tokens could not tell 1e-3 from noise.
# 32 x 96 = 3072 tokens put the standard error near 2e-4, a fifth of the default threshold.
SAMPLES = 32
SAMPLE_TOKENS = 96
LEARNING_RATE = 1e-4


def kl_sample_train_v1(sampler: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> float:
    """Mean over all sampled tokens of sampler logprob minus trainer logprob."""
    diffs = [
        s - t
        for seq_s, seq_t in zip(sampler, trainer, strict=True)
        for s, t in zip(seq_s, seq_t, strict=True)
    ]
    if not diffs:
        raise ValueError("no sampled tokens to compare")
    return sum(diffs) / len(diffs)


@dataclass
class SdkSession:
    """The clients one self-test uses, created by `train_step` and reused by the later steps."""

    service: Any
    training: Any
    sampling: Any = None
    vocab: int = 0


def _tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    # ids from the middle of the vocabulary: clear of special tokens at either end
    low, high = min(100, vocab // 4), max(vocab // 2, 2)
    return [rng.randrange(low, high) for _ in range(count)]


def _datum(types: Any, tokens: list[int]) -> Any:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def open_session(url: str, api_key: str, base_model: str, lora_rank: int | None, vocab: int) -> SdkSession:
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    rank = 0 if lora_rank is None else lora_rank  # rank 0: the job fully fine-tunes
    training = service.create_lora_training_client(base_model=base_model, rank=rank)
    return SdkSession(service, training, vocab=vocab)


def train_step(session: SdkSession) -> dict[str, Any]:
    """forward_backward (cross_entropy) and optim_step on a few random sequences."""
    from tinker import types

    rng = random.Random(0)
    data = [_datum(types, _tokens(rng, session.vocab, TRAIN_TOKENS)) for _ in range(TRAIN_SEQUENCES)]
    started = time.perf_counter()
    result = session.training.forward_backward(data, "cross_entropy").result()
    session.training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
    seconds = time.perf_counter() - started
    tokens = TRAIN_SEQUENCES * (TRAIN_TOKENS - 1)
    loss = result.metrics.get("loss:sum")
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "loss_sum": loss}


def push(session: SdkSession) -> dict[str, Any]:
    """save_weights_and_get_sampling_client: the trainer's weights (or adapter) onto every engine."""
    started = time.perf_counter()
    session.sampling = session.training.save_weights_and_get_sampling_client().result()
    return {"seconds": time.perf_counter() - started}


def sampler_vs_trainer(session: SdkSession) -> dict[str, Any]:
    """Sample at temperature 1 with logprobs, recompute the same tokens' logprobs on the trainer."""
    from tinker import types

    if session.sampling is None:
        raise RuntimeError("no sampling client: the push step did not run")
    prompt = _tokens(random.Random(1), session.vocab, PROMPT_TOKENS)
    params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=7)
    sampled = session.sampling.sample(types.ModelInput.from_ints(prompt), SAMPLES, params).result().sequences
    data, sampler_lp = [], []
    for seq in sampled:
        if seq.logprobs is None or len(seq.logprobs) != len(seq.tokens):
            raise RuntimeError(f"the sampler returned {len(seq.tokens)} tokens without their logprobs")
        data.append(_datum(types, prompt + list(seq.tokens)))
        sampler_lp.append(list(seq.logprobs))
    outputs = session.training.forward(data, "cross_entropy").result().loss_fn_outputs
    trainer_lp = [
        out["logprobs"].tolist()[-len(seq.tokens) :] for out, seq in zip(outputs, sampled, strict=True)
    ]
    diffs = [
        s - t for ss, ts in zip(sampler_lp, trainer_lp, strict=True) for s, t in zip(ss, ts, strict=True)
    ]
    return {
        "kl_sample_train_v1": kl_sample_train_v1(sampler_lp, trainer_lp),
        "standard_error": standard_error(diffs),
        "max_abs_diff": max(abs(d) for d in diffs),
        "tokens": len(diffs),
    }


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return (variance / len(values)) ** 0.5
