"""The transformers backend: torch + transformers (+ peft for LoRA) on one device, one DP rank.

Model keys: in "lora" mode each key is a named adapter on the shared frozen base (create_adapter first). In
"full" mode there is exactly one trainable model and every key names it (the gateway may pass its model id);
create_adapter is refused. Gradients accumulate over forward_backward calls until optim_step, like Tinker.

Data parallel (`dist` given): every rank gets the same full batch, preflights all of it, runs its contiguous
share, and all ranks return the full output. optim_step sums gradients over ranks before clipping and
stepping, so every rank stays identical. Files (save_state, exports) are written by rank 0 only; load_state
reads on every rank, so checkpoint paths must be on a filesystem all ranks see.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from miles.errors import UserError
from miles.train.backends import multi_tenant, offload, optim, optim_many
from miles.train.backends.base import (
    DataParallel,
    MergesForwardBackward,
    MergesOptimSteps,
    OffloadsTrainState,
    PushLayoutKeyed,
    StagesHfWeights,
)
from miles.train.backends.compile import compile_decoder_layers
from miles.train.backends.compute import (
    DEFAULT_CHUNK_TOKENS,
    DatumResult,
    LogprobOptions,
    forward_backward_output,
    run_datums,
)
from miles.train.backends.lora import LoraAdapters, peft_to_hf_name, spec_from_json, spec_to_json
from miles.train.backends.optim_guard import start_guarded_optim_step
from miles.train.backends.step_guard import (
    GradientStash,
    Refused,
    StepFailure,
    agreed_failure,
    describe,
    is_out_of_memory,
    out_of_memory_error,
    release_memory,
)
from miles.train.dist import DistContext, gather_shares, local_share
from miles.train.preflight import PreflightResult, batch_tokens, preflight
from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec
from miles.utils.memory import lay_out_back_to_back

if TYPE_CHECKING:
    from miles.train.commands import ForwardBackward, OptimStep

FULL_KEY = "full"
STATE_META = "miles_state.json"
STATE_WEIGHTS = "weights.safetensors"
STATE_FORMAT = 1
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass
class _Trainable:
    """Optimizer state for one trainable model (an adapter, or the full model)."""

    optimizer: torch.optim.AdamW | None = None


class TransformersBackend(
    MergesForwardBackward,
    MergesOptimSteps,
    PushLayoutKeyed,
    DataParallel,
    OffloadsTrainState,
    StagesHfWeights,
):
    def __init__(
        self,
        model_path: str,
        *,
        train_mode: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        dist: DistContext | None = None,
        max_tokens_per_micro_batch: int = 16384,
        logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        checkpoint_logprob_chunks: bool = True,
        compile_layers: bool | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        """`logprob_chunk_tokens` (0: full logits) and `checkpoint_logprob_chunks`: see compute.py.
        `compile_layers`: torch.compile each decoder layer; None means on for CUDA, off on CPU.
        `max_batch_tokens`: the per-request token budget preflight enforces; None = none."""
        if train_mode not in ("lora", "full"):
            raise UserError(f"train_mode must be 'lora' or 'full', got {train_mode!r}")
        self.train_mode = train_mode
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.dist = dist
        self.max_tokens = max_tokens_per_micro_batch
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise UserError(f"max_batch_tokens must be >= 1 (or unset), got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens
        if logprob_chunk_tokens < 0:
            raise UserError(f"logprob_chunk_tokens must be >= 0 (0: full logits), got {logprob_chunk_tokens}")
        self.logprob_options = LogprobOptions(logprob_chunk_tokens, checkpoint_logprob_chunks)
        self.compile_layers = self.device.type == "cuda" if compile_layers is None else compile_layers
        base = self._load_base()
        self.vocab_size = int(base.config.vocab_size)
        self.max_context = int(getattr(base.config, "max_position_embeddings", 1 << 31))
        self._full_model = base if train_mode == "full" else None
        self._lora = LoraAdapters(base, self.model_path) if train_mode == "lora" else None
        self._trainables: dict[str, _Trainable] = {FULL_KEY: _Trainable()} if train_mode == "full" else {}
        self._offloaded = offload.OffloadedState(self.device)

    def _load_base(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.to(self.device)
        # Parameters back to back in HF order: a weight push then sends its buckets as views, unpacked.
        lay_out_back_to_back(model)
        model.eval()  # no dropout: training is deterministic and ranks agree
        if self.compile_layers:
            compile_decoder_layers(model)
        return model

    # ---- model keys -------------------------------------------------------------------------------

    def create_adapter(self, key: str, spec: LoraSpec) -> None:
        lora = self._require_lora("create_adapter")
        lora.create(key, spec)
        self._trainables[key] = _Trainable()

    def remove_adapter(self, key: str) -> None:
        self._require_lora("remove_adapter").remove(key)
        del self._trainables[key]

    def has_adapter(self, key: str) -> bool:
        return self._lora is not None and self._lora.has(key)

    def model_keys(self) -> list[str]:
        return self._lora.keys() if self._lora is not None else [FULL_KEY]

    def _require_lora(self, what: str) -> LoraAdapters:
        if self._lora is None:
            raise UserError(f"{what} needs a LoRA trainer; this one trains the full model")
        return self._lora

    def _trainable_key(self, key: str) -> str:
        return key if self._lora is not None else FULL_KEY

    def named_trainable_parameters(self, key: str) -> list[tuple[str, torch.nn.Parameter]]:
        """What optim_step updates for `key` (LoRA: PEFT names without the adapter name; full: HF names)."""
        return self._activate(key)[1]

    def optimizer_of(self, key: str) -> torch.optim.AdamW | None:
        """`key`'s AdamW (None before its first optim_step): hybrid lanes copy and compare it."""
        return self._trainables[self._trainable_key(key)].optimizer

    def install_optimizer(self, key: str, optimizer: torch.optim.AdamW | None) -> None:
        """Replace `key`'s optimizer (a hybrid lane joining takes the core's state)."""
        self._trainables[self._trainable_key(key)].optimizer = optimizer

    def _activate(self, key: str) -> tuple[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]:
        """The model to run for `key` and its trainable parameters (stable names)."""
        if self._lora is not None:
            adapter = self._lora.get(key)
            return self._lora.model, self._lora.activate(adapter)
        assert self._full_model is not None
        return self._full_model, list(self._full_model.named_parameters())

    def _parameters_of(self, key: str) -> list[tuple[str, torch.nn.Parameter]]:
        """`key`'s trainable parameters without routing the model through it (an optim_step needs only
        these; peft's routing walks every module)."""
        if self._lora is not None:
            return self._lora.named_parameters(self._lora.get(key))
        assert self._full_model is not None
        return list(self._full_model.named_parameters())

    # ---- training ---------------------------------------------------------------------------------

    def forward_backward(
        self,
        key: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_config: Mapping[str, float],
        forward_only: bool = False,
    ) -> ForwardBackwardOutput:
        """Running out of memory is the caller's UserError: this call's work is dropped (step_guard)."""
        checked = preflight(
            data,
            loss_fn,
            loss_config,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            max_batch_tokens=self.max_batch_tokens,
        )
        model, named = self._activate(key)
        mine = local_share(data, self.dist)
        stash = None if forward_only else GradientStash(p for _, p in named)
        try:
            results, own = self._run_guarded(model, mine, checked, backward=not forward_only)
            any_failed, failure = agreed_failure(own, self.dist, self.device)
        except BaseException:  # any other error: the earlier gradients are still this step's
            if stash is not None:
                stash.restore()
            raise
        if any_failed:
            results = []
            if stash is not None:
                stash.restore()
            release_memory(self.device)
            if isinstance(failure, Refused):
                raise UserError(failure.message)
            what = "forward" if forward_only else "forward_backward"
            raise out_of_memory_error(what, failure, len(data), batch_tokens(data), self.max_batch_tokens)
        if stash is not None:
            stash.merge()
        return forward_backward_output(gather_shares(results, self.dist))

    def forward_backward_many(
        self, requests: Sequence[ForwardBackward]
    ) -> list[ForwardBackwardOutput | UserError]:
        """Several LoRA models' requests in one pass over the base (multi_tenant.py); one outcome each."""
        return multi_tenant.forward_backward_many(self, requests)

    @property
    def lora(self) -> LoraAdapters | None:
        """The adapters on the frozen base; None when this trainer trains the full model."""
        return self._lora

    def _run_guarded(
        self, model: torch.nn.Module, mine: list[Datum], checked: PreflightResult, *, backward: bool
    ) -> tuple[list[DatumResult], StepFailure | None]:
        """run_datums, with an allocation failure or a UserError (e.g. a custom loss's guard at a datum
        of this rank's share) returned as a message, for every rank to agree on. Leaving the except block
        drops the traceback and with it every frame that held the failed call's activations."""
        try:
            results = run_datums(
                model,
                mine,
                checked.loss,
                checked.loss_config,
                device=self.device,
                backward=backward,
                max_tokens=self.max_tokens,
                options=self.logprob_options,
            )
        except UserError as exc:
            return [], Refused(str(exc))
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            return [], describe(exc)
        return results, None

    def optim_step(self, key: str, adam: AdamParams, *, reduce: bool = True) -> dict[str, float]:
        """Out of memory while preparing the step is the caller's UserError, nothing changed (optim_guard).
        `reduce=False`: the caller summed the gradients over the ranks already (a hybrid core lane)."""
        return optim.step_metrics(self._start_optim_step(key, adam, reduce=reduce), adam)

    def optim_step_many(self, requests: Sequence[OptimStep]) -> list[dict[str, float] | UserError]:
        """Several models' optim_steps queued back to back (optim_many.py); one outcome each."""
        return optim_many.optim_step_many(self._start_optim_step, requests)

    def _start_optim_step(self, key: str, adam: AdamParams, *, reduce: bool = True) -> torch.Tensor:
        """optim_step with its gradient norm left on the device (reading it waits for the step)."""
        optim.validate_adam(adam)
        params = [p for _, p in self._parameters_of(key)]
        trainable = self._trainables[self._trainable_key(key)]
        optimizer = trainable.optimizer or optim.new_adamw(params, adam)
        grad_norm = start_guarded_optim_step(optimizer, params, adam, self.dist, self.device, reduce=reduce)
        trainable.optimizer = optimizer  # a first step that failed leaves no optimizer, as before it
        return grad_norm

    def reset(self, key: str) -> None:
        """Back to the initial weights with a fresh optimizer and no pending gradients."""
        if self._lora is not None:
            adapter = self._lora.get(key)
            self._lora.load_state_dict(adapter, adapter.initial_state)
        else:
            assert self._full_model is not None
            fresh = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
            self._full_model.load_state_dict(fresh.state_dict())
        _, named = self._activate(key)
        for _, param in named:
            param.grad = None
        self._trainables[self._trainable_key(key)] = _Trainable()

    # ---- state ------------------------------------------------------------------------------------

    def _state_tensors(self, key: str) -> dict[str, torch.Tensor]:
        if self._lora is not None:
            return self._lora.state_dict(self._lora.get(key))
        return {name: p for name, p in self._activate(key)[1]}

    def save_state(self, key: str, path: Path, *, with_optimizer: bool) -> None:
        """A directory: miles_state.json, weights.safetensors, optionally optimizer.safetensors/.json."""
        _, named = self._activate(key)
        if self.dist is not None and not self.dist.is_primary:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self._state_tensors(key).items()}
        save_file(tensors, str(path / STATE_WEIGHTS))
        optimizer = self._trainables[self._trainable_key(key)].optimizer
        saved_optimizer = with_optimizer and optimizer is not None
        if saved_optimizer:
            optim.save_optimizer(optimizer, [n for n, _ in named], [p for _, p in named], path)
        meta = {
            "format": STATE_FORMAT,
            "train_mode": self.train_mode,
            "lora_spec": spec_to_json(self._lora.get(key).spec) if self._lora is not None else None,
            "has_optimizer": saved_optimizer,
            # asked for, but no optim_step has run yet: the optimizer state is empty, and loading it
            # "with optimizer" gives the same fresh Adam (a recipe resuming its own first checkpoint)
            "optimizer_empty": with_optimizer and optimizer is None,
        }
        (path / STATE_META).write_text(json.dumps(meta, indent=2) + "\n")

    def load_state(self, key: str, path: Path, *, with_optimizer: bool) -> None:
        """Restore weights (and optimizer state); a LoRA key that does not exist yet is created."""
        path = Path(path)
        meta = self._read_state_meta(path)
        if self._lora is not None:
            saved = spec_from_json(meta["lora_spec"])
            if not self._lora.has(key):
                self.create_adapter(key, saved)
            current = self._lora.get(key).spec
            if (current.rank, current.train_attn, current.train_mlp, current.train_unembed) != (
                saved.rank,
                saved.train_attn,
                saved.train_mlp,
                saved.train_unembed,
            ):
                # a shape mismatch inside peft would be a server error that ends the trainer cell
                raise UserError(
                    f"checkpoint {path} holds a LoRA adapter of rank {saved.rank} on different modules "
                    f"or rank than model {key} (rank {current.rank}); create the model from the "
                    "checkpoint instead (create_training_client_from_state)"
                )
        tensors = load_file(str(path / STATE_WEIGHTS))
        if self._lora is not None:
            self._lora.load_state_dict(self._lora.get(key), tensors)
        else:
            self._load_full_tensors(tensors)
        _, named = self._activate(key)
        params = [p for _, p in named]
        for param in params:
            param.grad = None
        trainable = _Trainable()
        if with_optimizer and not meta.get("optimizer_empty"):
            if not meta.get("has_optimizer"):
                raise UserError(
                    f"checkpoint {path} was saved without optimizer state (a sampler snapshot or "
                    "save_state without the optimizer); load it without the optimizer"
                )
            trainable.optimizer = optim.new_adamw(params)
            optim.load_optimizer(trainable.optimizer, [n for n, _ in named], params, path)
        self._trainables[self._trainable_key(key)] = trainable

    def _read_state_meta(self, path: Path) -> dict:
        meta_path = path / STATE_META
        if not meta_path.is_file():
            raise UserError(f"{path} is not a trainer checkpoint (no {STATE_META})")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != STATE_FORMAT or meta.get("train_mode") != self.train_mode:
            raise UserError(
                f"checkpoint {path} is {meta.get('train_mode')!r} (format {meta.get('format')}); "
                f"this trainer is {self.train_mode!r} (format {STATE_FORMAT})"
            )
        return meta

    def _load_full_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self._full_model is not None
        params = dict(self._full_model.named_parameters())
        if set(tensors) != set(params):
            raise UserError(
                "checkpoint parameters do not match the model: "
                f"missing {sorted(set(params) - set(tensors))[:3]}, "
                f"unexpected {sorted(set(tensors) - set(params))[:3]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])

    # ---- exports ----------------------------------------------------------------------------------

    def export_adapter(self, key: str, path: Path) -> None:
        lora = self._require_lora("export_adapter")
        adapter = lora.get(key)
        if self.dist is None or self.dist.is_primary:
            lora.export(adapter, Path(path))

    def export_hf_weights(self, path: Path) -> None:
        """The full model in HF names with config and tokenizer files: loadable by from_pretrained."""
        model = self._require_full("export_hf_weights")
        if self.dist is not None and not self.dist.is_primary:
            return
        self._write_hf(Path(path), model.state_dict())

    def stage_hf_weights(self) -> Callable[[Path], None] | None:
        """A host copy of the full model now; the writer writes it as export_hf_weights does. Tensors that
        share memory (tied embeddings) share their copy too, so the files are the same as a direct export."""
        model = self._require_full("export_hf_weights")
        if self.dist is not None and not self.dist.is_primary:
            return None
        copies: dict[int, torch.Tensor] = {}
        host: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            key = tensor.data_ptr()
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            host[name] = copies[key]
        return functools.partial(self._write_hf, state=host)

    def _write_hf(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        path.mkdir(parents=True, exist_ok=True)
        model = self._require_full("export_hf_weights")
        model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        self._copy_model_files(path)

    def _require_full(self, what: str) -> Any:
        if self._full_model is None:
            raise UserError(f"{what} needs a full-model trainer; LoRA trainers export adapters")
        return self._full_model

    def export_merged_hf_weights(self, key: str, path: Path) -> None:
        """Model `key` as a standalone HF directory (save_weights_external): full fine-tuning writes the
        model; LoRA writes the base with the adapter merged in, so no peft is needed to load it."""
        if self._lora is None:
            self.export_hf_weights(path)
            return
        adapter = self._lora.get(key)
        if self.dist is not None and not self.dist.is_primary:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors, touched = self._lora.merged_weights(adapter, peft_to_hf_name)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        self._copy_model_files(path)
        config = json.loads((path / "config.json").read_text())
        if config.get("tie_word_embeddings") and "lm_head.weight" in touched:
            # the adapter changed the unembedding only: the merged model has two different matrices
            config["tie_word_embeddings"] = False
            (path / "config.json").write_text(json.dumps(config, indent=2))

    def _copy_model_files(self, path: Path) -> None:
        """The base directory's config, tokenizer and generation files (never its weights) into `path`."""
        for source in Path(self.model_path).iterdir():
            target = path / source.name
            if source.is_file() and not source.name.endswith(WEIGHT_FILE_SUFFIXES) and not target.exists():
                shutil.copy2(source, target)

    # ---- colocation: state off the GPU while the engines sample ------------------------------------

    def offload_train_state(self, what: Sequence[str]) -> dict[str, int]:
        """Optimizer state and/or gradients to pinned host memory (offload.py); bytes moved per kind."""
        self.reload_train_state()  # twice in a row moves nothing twice
        optimizers = [t.optimizer for t in self._trainables.values() if t.optimizer is not None]
        model = self._full_model if self._full_model is not None else self._require_lora("offload").model
        params = [p for p in model.parameters() if p.requires_grad]
        self._offloaded, moved = offload.offload(what, optimizers, params, self.device)
        return moved

    def reload_train_state(self) -> int:
        return offload.reload(self._offloaded)

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights in HF parameter names; for LoRA the frozen base (adapters travel as PEFT dirs)."""
        if self._lora is not None:
            yield from self._lora.iter_base_weights(peft_to_hf_name)
            return
        assert self._full_model is not None
        for name, tensor in self._full_model.state_dict().items():
            yield name, tensor.detach()

    def push_layout_key(self) -> tuple[int, ...] | None:
        """Where the full model's parameters lie: the weight push reuses its walk of iter_hf_weights while
        this is unchanged (miles/weights/sender.py). Parameters are copied into (steps, loads, reset), never
        replaced after load, so their memory is what can change; None (always walk) for LoRA. The
        parameters are walked afresh each time (a fraction of a millisecond), so a Parameter object that
        was replaced after all is seen too."""
        if self._full_model is None:
            return None
        return tuple(param.data_ptr() for param in self._full_model.parameters())
