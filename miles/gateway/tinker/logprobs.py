"""Tinker's extra sampling logprob fields: the request's checks (what the hosted service refuses) and the
`target_prompt_logprobs` tensor, dense or sparse CSR, in and out.

Cost bound: a prompt-wide field costs len(prompt) x its width (top-k width, distinct target ids, draws per
position), and `topk_sample_logprobs` costs max_tokens x its width per sample; each is refused above
`MAX_LOGPROB_CELLS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.gateway.errors import bad_request
from miles.types import LogprobSpec

MAX_LOGPROB_CELLS = 1 << 20
# The target matrix is made dense ([len(prompt) - 1, K] int64, then float32 logprobs): a sparse request
# may not name a K that makes it larger than this many cells.
MAX_TARGET_CELLS = 1 << 22
UNSET_MAX_TOKENS = 256  # what the runtime generates when a request gives no max_tokens


@dataclass(frozen=True)
class TargetLayout:
    """Where the request's target ids sat, so the answer comes back in the same layout."""

    shape: tuple[int, int]
    crow: np.ndarray | None = None  # int64, sparse CSR only
    col: np.ndarray | None = None


def _check_width(name: str, width: int, length: int) -> None:
    if width < 0:
        raise bad_request(f"{name} must be 0 or greater, got {width}")
    if width * length > MAX_LOGPROB_CELLS:
        raise bad_request(
            f"{name}={width} over {length} positions is {width * length} logprobs; this server answers at "
            f"most {MAX_LOGPROB_CELLS} per field: lower it or shorten the prompt"
        )


def target_ids(tensor: dict[str, Any], prompt_len: int) -> tuple[np.ndarray, TargetLayout]:
    """The TensorData JSON of `target_prompt_logprobs` as a dense int64 [len(prompt) - 1, K] (-1 = none)."""
    name = "target_prompt_logprobs"
    if tensor.get("dtype") != "int64":
        raise bad_request(f"{name} must be an int64 tensor of token ids, got dtype {tensor.get('dtype')!r}")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or any(type(d) is not int or d < 0 for d in shape):
        raise bad_request(f"{name} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    rows, cols = shape
    if rows != prompt_len - 1:
        raise bad_request(f"{name} has {rows} rows; a {prompt_len}-token prompt needs {prompt_len - 1}")
    if rows * cols > MAX_TARGET_CELLS:
        raise bad_request(
            f"{name} shape {shape} has more than {MAX_TARGET_CELLS} cells; ask for fewer ids (K)"
        )
    try:
        values = np.asarray(tensor.get("data", []), dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: an id beyond int64
        raise bad_request(f"{name}.data must be a list of integers") from exc
    if tensor.get("sparse_crow_indices") is not None:
        dense, layout = _from_csr(tensor, values, rows, cols)
    else:
        if values.size != rows * cols:
            raise bad_request(f"{name}: shape {shape} does not match {values.size} values")
        dense, layout = values.reshape(rows, cols), TargetLayout((rows, cols))
    if np.any(dense < -1):
        raise bad_request(f"{name} holds token ids, or -1 for cells you don't need; found {int(dense.min())}")
    distinct = np.unique(dense[dense >= 0]).size
    if distinct == 0:
        raise bad_request(f"{name} names no token id; give at least one (cells of -1 request nothing)")
    _check_width(f"{name} (distinct ids)", distinct, prompt_len)
    return dense, layout


def _from_csr(
    tensor: dict[str, Any], values: np.ndarray, rows: int, cols: int
) -> tuple[np.ndarray, TargetLayout]:
    try:
        crow = np.asarray(tensor["sparse_crow_indices"], dtype=np.int64)
        col = np.asarray(tensor.get("sparse_col_indices") or [], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad_request("target_prompt_logprobs: sparse CSR indices must be integer lists") from exc
    valid = (
        crow.size == rows + 1
        and col.size == values.size
        and crow[0] == 0
        and crow[-1] == values.size
        and bool(np.all(np.diff(crow) >= 0))
        and (col.size == 0 or (col.min() >= 0 and col.max() < cols))
    )
    if not valid:
        raise bad_request(
            f"target_prompt_logprobs: inconsistent sparse CSR indices for shape [{rows}, {cols}]"
        )
    dense = np.full((rows, cols), -1, dtype=np.int64)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense, TargetLayout((rows, cols), crow, col)


def logprob_spec(
    body: Any, prompt_len: int, max_tokens: int | None
) -> tuple[LogprobSpec, TargetLayout | None]:
    """The request's logprob fields (a SampleBody), checked as the hosted service checks them.
    `max_tokens` None: the runtime's default length (`UNSET_MAX_TOKENS`) bounds topk_sample_logprobs."""
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not body.prompt_logprobs:
            raise bad_request("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if not 1 <= last_n <= prompt_len - 1:
            raise bad_request(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, "
                f"got {last_n}"
            )
    _check_width("topk_prompt_logprobs", body.topk_prompt_logprobs, prompt_len)
    _check_width("topk_sample_logprobs", body.topk_sample_logprobs, max_tokens or UNSET_MAX_TOKENS)
    _check_width("prompt_alt_tokens_k", body.prompt_alt_tokens_k, prompt_len)
    target, layout = None, None
    if body.target_prompt_logprobs is not None:
        target, layout = target_ids(body.target_prompt_logprobs, prompt_len)
    spec = LogprobSpec(
        prompt=bool(body.prompt_logprobs),
        prompt_last_n=last_n,
        topk_prompt=body.topk_prompt_logprobs,
        topk_sample=body.topk_sample_logprobs,
        target_prompt=target,
        alt_tokens_k=body.prompt_alt_tokens_k,
    )
    return spec, layout
