"""The model side of the CPU engine: load a Hugging Face directory, run forwards, swap weights and adapters.

Not thread-safe by design: the engine calls every method from one worker thread, so forwards, weight loads
and adapter switches are serialised without locks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from miles.engines.cpu.graphs import DecodeCounts, DecodeOptions, resolve_mode
from miles.engines.cpu.lora import LoraAdapter, load_adapter
from miles.engines.cpu.memory import WEIGHTS_RELEASED, ReleasedWeights, release_weights, resume_weights
from miles.engines.errors import EngineRefused
from miles.utils.memory import byte_span

Spec = tuple[str, torch.dtype, list[int]]  # a received tensor: HF name, dtype, shape


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.stride() == b.stride()


def pick_device() -> torch.device:
    # indexed: a parameter's device is cuda:0, and torch.device("cuda") != torch.device("cuda:0"), so an
    # unindexed device never matched a parameter (no in-place receive, no delta applied on a GPU)
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


_DTYPE_ALIASES = {"half": torch.float16, "float": torch.float32}


def _load_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    """--dtype as from_pretrained takes it. auto: float32 on CPU (bf16 matmuls are slow there and the
    tests compare logprobs to 1e-4), the model's own dtype elsewhere (as SGLang's auto)."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    return _DTYPE_ALIASES.get(dtype) or getattr(torch, dtype)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        device: torch.device | None = None,
        dtype: str = "auto",
        *,
        decode: DecodeOptions = DecodeOptions(),
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path).resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model-path {path} is not a Hugging Face model directory (no config.json)"
            )
        self.model_path = str(path)
        self.device = device or pick_device()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        loaded = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_load_dtype(dtype, self.device))
        self.model = loaded.to(self.device).eval()
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters(remove_duplicate=False))
        self.adapters: dict[str, LoraAdapter] = {}
        self.active_adapter: str | None = None
        self._base_copies: dict[str, torch.Tensor] = {}
        # A bucket layout's in-place receive target, found once per layout: finding it walks every tensor
        # of the bucket (a third of the engine's time per bucket on GPU, docs/weights.md). Valid until a
        # load gives a parameter other memory, which clears it.
        self._flat_targets: dict[tuple[Any, ...], torch.Tensor | None] = {}
        self.released_weights: ReleasedWeights | None = None  # set while the weights' memory is released
        self.eos_token_ids = self._eos_ids()
        attention = str(getattr(self.model.config, "_attn_implementation", None))
        # the decode path (graphs.py); a failed capture turns `graphs` to `slots`
        self.decode_mode = resolve_mode(decode, self.device, self.batchable, attention)
        self.graph_max_bs = decode.graph_max_bs
        self.decode_counts = DecodeCounts()  # the fixed-slot steps only (the dynamic path counts none)
        self._capture_stream: Any = None

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ----- forward ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: list[int], past: Any, adapter: str | None) -> tuple[torch.Tensor, Any]:
        """Logits [len(input_ids), vocab] (float32, CPU) for the new tokens, and the updated KV cache."""
        self._activate(adapter)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=past, use_cache=True)
        return out.logits[0].float().cpu(), out.cache

    @torch.inference_mode()
    def forward_batch(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        adapter: str | None,
        *,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """One forward of a left-padded batch (kvbatch.py): float32 logits on the model's device, [rows,
        columns, vocab] with `all_logits`, else [rows, 1, vocab] (the last column: every row's newest token),
        and the updated cache."""
        self._activate(adapter)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        return out.logits.float(), out.cache

    def activate(self, adapter: str | None) -> None:
        """Fold `adapter` into the weights (None: the base weights), for a forward run outside this class."""
        self._activate(adapter)

    def weights_key(self) -> tuple[int, ...]:
        """Where every parameter's memory is: a captured graph is valid while this stays the same."""
        return tuple(param.data_ptr() for param in self.params.values())

    def capture_stream(self) -> Any:
        """The one CUDA stream graphs are captured on (and their warm-up steps run on)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    @functools.cached_property
    def batchable(self) -> bool:
        """Whether sequences can share a left-padded cache (kvbatch.py): every layer a plain full-attention
        DynamicLayer. Sliding-window or linear-attention caches keep their own offsets, so such models step
        one sequence at a time."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        try:
            layers = DynamicCache(config=self.model.config).layers
        except (TypeError, ValueError, KeyError):
            return False
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    # ----- adapters --------------------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        shapes = {n: p.shape for n, p in self.params.items()}
        adapter = load_adapter(name, path, shapes)
        if self.active_adapter == name:
            self._activate(None)
        self.adapters[name] = adapter

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        if self.active_adapter == name:
            self._activate(None)
        del self.adapters[name]

    @torch.no_grad()
    def _activate(self, adapter: str | None) -> None:
        if adapter == self.active_adapter:
            return
        for name, base in self._base_copies.items():
            self.params[name].data.copy_(base)
        self._base_copies.clear()
        self.active_adapter = None
        if adapter is None:
            return
        for name, delta in self.adapters[adapter].deltas.items():
            param = self.params[name]
            self._base_copies[name] = param.data.clone()
            param.data.add_(delta.to(device=param.device, dtype=param.dtype))
        self.active_adapter = adapter

    # ----- weights ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool = False) -> list[str]:
        """Make `named` the parameters of the same HF name; return the names that are not parameters.

        A tensor that already is its parameter's memory (received in place) is left as it is; a contiguous
        one of the parameter's dtype and device becomes the parameter's memory (no copy: a push hands its
        receive buffer over, and the next push with the same buckets receives into it in place); any
        other is copied in. `copy=True` copies every tensor in: tensors mapped from another process (CUDA
        IPC, shared memory) belong to their sender and must never become a parameter's memory."""
        self._require_resident()
        self._activate(None)
        unknown: list[str] = []
        targets, sources = [], []
        for name, tensor in named:
            param = self.params.get(name)
            if param is None or tuple(param.shape) != tuple(tensor.shape):
                unknown.append(name)
                continue
            if _same_memory(param.data, tensor):
                continue
            same_place = tensor.dtype == param.dtype and tensor.device == param.device
            if same_place and tensor.is_contiguous() and not copy:
                param.data = tensor
                self._flat_targets.clear()
            else:
                targets.append(param.data)
                sources.append(tensor.to(device=param.device, dtype=param.dtype))
        if targets:  # a few multi-tensor kernels instead of one copy launch per tensor (hundreds a push)
            torch._foreach_copy_(targets, sources)
        return unknown

    @torch.no_grad()
    def flat_target(self, specs: Sequence[Spec], device: torch.device) -> torch.Tensor | None:
        """The parameters' own memory as one byte buffer, when `specs` name parameters that lie back to back
        in exactly this order, dtype and shape on `device` (as after an earlier push with the same buckets):
        the bucket is then received in place, with no copy and no fresh pages. Else None."""
        self._require_resident()  # a released parameter has no memory to receive into
        self._activate(None)  # the memory must hold the base weights, no adapter folded in
        key = (device, *((name, dtype, *shape) for name, dtype, shape in specs))
        if key not in self._flat_targets:
            tensors = [self._receivable(spec, device) for spec in specs]
            found = None if any(t is None for t in tensors) else byte_span(tensors)  # type: ignore[arg-type]
            self._flat_targets[key] = found
        return self._flat_targets[key]

    def base_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter's memory holding the base weights (no adapter folded in), for checksums."""
        self._require_resident()
        self._activate(None)
        return [(name, param.data) for name, param in self.params.items()]

    @torch.no_grad()
    def tensor_targets(self, specs: Sequence[Spec], device: torch.device) -> list[torch.Tensor | None]:
        """Per tensor of a bucket sent tensor by tensor: its parameter's memory to receive into, or None."""
        self._require_resident()
        self._activate(None)
        return [self._receivable(spec, device) for spec in specs]

    def _receivable(self, spec: Spec, device: torch.device) -> torch.Tensor | None:
        name, dtype, shape = spec
        param = self.params.get(name)
        if param is None:
            return None
        data = param.data
        matches = data.dtype == dtype and tuple(data.shape) == tuple(shape) and data.device == device
        return data if matches and data.is_contiguous() else None

    # ----- memory occupation (miles.engines.cpu.memory) ----------------------------------------------------

    def release_weights_memory(self, *, cpu_backup: bool) -> None:
        """Free the weights' device memory (release_memory_occupation with the memory saver)."""
        if self.released_weights is not None:
            return
        self._activate(None)  # what is kept (or dropped) is the base weights, no adapter folded in
        self._flat_targets.clear()  # cached receive views may name storages the release replaces
        self.released_weights = release_weights(self, cpu_backup=cpu_backup)

    def resume_weights_memory(self) -> None:
        """Allocate the weights' memory again (their content restored when a CPU backup was kept)."""
        if self.released_weights is None:
            return
        resume_weights(self, self.released_weights)
        self.released_weights = None
        self._flat_targets.clear()

    def _require_resident(self) -> None:
        if self.released_weights is not None:
            raise EngineRefused(WEIGHTS_RELEASED)
