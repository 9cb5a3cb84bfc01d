"""The decode step over a SlotBatch (slots.py), eager or replayed as a CUDA graph, and which of the engine's
decode paths a model runs.

On a GPU a decode step of a small model is bound by the CPU launching its kernels (~1,400 a forward for the
Qwen3-0.6B shape; docs/colocation.md): the GPU finishes each before the next is issued. A CUDA graph
launches the whole forward at once. A graph replays fixed shapes at fixed addresses, which is what a
SlotBatch keeps: its buffers, mask, positions and write column are read by the graph in place, and only the
step's input ids are copied in. So a batch's first decode step runs eagerly on the capture stream (the
warm-up: lazy handles and cuDNN's attention plan for the shape), the next one captures the forward, and
every later step of the same buffers replays it. Rows ending or joining keep the buffers (slots.py); a regrow
makes new ones and a new capture. SGLang does the same with graphs per batch size captured at start; here
they are captured per batch, as batches come.

A graph also bakes in the weights' addresses. A weight update in place (every push of this engine) keeps
them; one that gives a parameter new memory (a resume of released weights, a load that adopts a tensor)
does not, so each replay first compares the weights' addresses with the capture's and captures again when
they moved.

Paths (`DECODE_MODES`): `dynamic` (kvbatch.py, the cache grown a column a step: models whose cache is not one
plain full-attention layer each, or `--decode-cache dynamic`), `slots` (fixed buffers, eager: CPU, or
`--disable-decode-cuda-graph`), `graphs` (slots, replayed: CUDA).
A capture that fails turns the runner to `slots` for good, with a warning: a graph is a speed-up, never a
reason to fail a request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles.contract.engine_args import DEFAULT_GRAPH_MAX_BS
from miles.engines.cpu import slots
from miles.engines.cpu.slots import SlotBatch, SlotCache

if TYPE_CHECKING:
    from miles.engines.cpu.runner import ModelRunner

log = logging.getLogger(__name__)

DECODE_MODES = ("dynamic", "slots", "graphs")
DECODE_CACHES = ("auto", "slots", "dynamic")  # the engine's --decode-cache


@dataclass
class DecodeCounts:
    """How a runner's decode steps ran (/server_info's `decode_counts`, beside `decode_mode`): the bench and
    an operator see whether graphs replay."""

    eager: int = 0  # steps run eagerly (the slots path, a batch's warm-up step, a batch above the bucket cap)
    captures: int = 0  # graphs captured (a new batch's buffers, or weights that moved)
    replays: int = 0  # steps replayed from a graph
    capture_failures: int = 0  # captures that failed (the runner then decodes eagerly for good)
    capture_s: float = 0.0  # seconds spent capturing (the step that captures pays them)

    def as_dict(self) -> dict[str, float]:
        return {**vars(self), "capture_s": round(self.capture_s, 4)}


@dataclass(frozen=True)
class DecodeOptions:
    """The engine's decode flags: `cache` (auto: slots where the model allows), `graphs` (SGLang's
    --disable-decode-cuda-graph turns it off) and the largest batch captured."""

    cache: str = "auto"
    graphs: bool = True
    graph_max_bs: int = DEFAULT_GRAPH_MAX_BS

    def __post_init__(self) -> None:
        if self.cache not in DECODE_CACHES:
            raise ValueError(f"decode cache {self.cache!r}: use one of {list(DECODE_CACHES)}")
        if self.graph_max_bs < 1:
            raise ValueError(f"cuda-graph-max-bs-decode must be at least 1, got {self.graph_max_bs}")


def resolve_mode(options: DecodeOptions, device: torch.device, batchable: bool, attention: str) -> str:
    """The decode path a runner uses: slots unless asked for the dynamic cache or the model cannot (a cache
    other than one plain full-attention layer each, kvbatch.py; attention that does not take a boolean 4-D
    mask, i.e. not SDPA); replayed as graphs on CUDA unless turned off."""
    if options.cache == "dynamic" or not (batchable and attention == "sdpa"):
        return "dynamic"
    return "graphs" if options.graphs and device.type == "cuda" else "slots"


@torch.inference_mode()
def forward_slots(model: Any, batch: SlotBatch, ids: torch.Tensor) -> torch.Tensor:
    """Float logits [slots, vocab] of one decode step; `ids` [slots, 1] on the model's device. Writes the
    step's keys and values at the write column; the mask, positions and column are the batch's own tensors
    (what a captured graph reads)."""
    out = model(
        input_ids=ids,
        attention_mask=batch.mask[:, None, None, :],  # 4-D: used as it is, no mask built from the cache
        position_ids=batch.next_pos[:, None],
        cache=SlotCache(batch),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


class DecodeGraph:
    """One batch's decode forward, captured: `run` copies the step's ids in and replays."""

    def __init__(self, model: Any, batch: SlotBatch, weights: tuple[int, ...], stream: Any) -> None:
        self.weights = weights
        self.ids = torch.zeros((batch.slots, 1), dtype=torch.long, device=batch.mask.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.logits = forward_slots(model, batch, self.ids)

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits


def decode(runner: ModelRunner, batch: SlotBatch, tokens: list[int]) -> torch.Tensor:
    """One decode step of every row of `batch` (its pending tokens `tokens`, in row order): float logits
    [rows, vocab] on the model's device. The adapter must be active already."""
    slots.open_column(batch)
    ids = slots.step_ids(batch, tokens)
    if _graphs_for(runner, batch):
        logits = _graphed(runner, batch, ids)
    else:
        logits = forward_slots(runner.model, batch, ids.to(batch.mask.device))
        batch.eager_steps += 1
        runner.decode_counts.eager += 1
    slots.advance(batch)
    rows = torch.tensor(batch.row_slots, dtype=torch.long, device=logits.device)
    return logits.index_select(0, rows)


def _graphs_for(runner: ModelRunner, batch: SlotBatch) -> bool:
    return runner.decode_mode == "graphs" and batch.slots <= runner.graph_max_bs


def _graphed(runner: ModelRunner, batch: SlotBatch, ids: torch.Tensor) -> torch.Tensor:
    weights = runner.weights_key()
    graph = batch.graph
    counts = runner.decode_counts
    if graph is not None and graph.weights == weights:
        counts.replays += 1
        return graph.run(ids)
    batch.graph = None
    stream = runner.capture_stream()
    device_ids = ids.to(batch.mask.device)
    if batch.eager_steps == 0:  # the warm-up, on the stream the capture uses; it is this step's forward
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = forward_slots(runner.model, batch, device_ids)
        torch.cuda.current_stream().wait_stream(stream)
        batch.eager_steps += 1
        counts.eager += 1
        return logits
    started = time.perf_counter()
    try:
        batch.graph = DecodeGraph(runner.model, batch, weights, stream)
    except Exception:  # any capture failure: decode eagerly from now on, never fail the step
        log.warning("capturing the decode step failed; decoding eagerly from now on", exc_info=True)
        runner.decode_mode = "slots"
        counts.capture_failures += 1
        counts.eager += 1
        return forward_slots(runner.model, batch, device_ids)
    counts.captures += 1
    counts.capture_s += time.perf_counter() - started
    counts.replays += 1
    return batch.graph.run(ids)
