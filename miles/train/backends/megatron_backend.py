"""The megatron backend: megatron-core's GPT with tensor and data parallelism, full fine-tuning or LoRA.

One instance per rank of the trainer cell; the cell's ranks are all of the trainer's GPUs, and megatron cuts
them into TP groups (consecutive ranks, so one node's NVLink) and DP groups. Every rank receives the whole
batch and preflights all of it (symmetric: a bad batch fails everywhere before any collective); each DP
group runs its contiguous share, the ranks of one TP group the same datums. Gradients of the summed loss
accumulate in megatron's DDP buffers until optim_step, which reduce-scatters them (summed over DP), steps
megatron's distributed optimizer with the request's AdamW parameters and all-gathers the new weights.

Weights come from a Hugging Face Qwen3 checkpoint (each rank reads only its own shards) and leave in HF
names, gathered over TP one tensor at a time (miles.train.megatron.model). Checkpoints (save_state) are
per TP rank (x pipeline stage) in megatron names, with the optimizer per TP x DP (x CP) rank: the weights load
at any data and context size, the optimizer only under the layout that wrote it.

megatron-core is the `gpu` extra: it is imported when a backend starts, never when this module loads.
LoRA (train_mode lora): named adapters on the frozen base (miles.train.megatron.lora), each with its own
AdamW, saved and exported in PEFT names. The weight push gathers over TP bucket by bucket with the first DP
replica's TP ranks (miles.train.megatron.push). Pipeline parallelism: each pipeline rank builds and loads its
own stage, commands run megatron's 1F1B schedule, the export and the push bring each stage's tensors to rank
0 one at a time (miles.train.megatron.pipeline, pipeline_weights); under LoRA each stage holds and steps its
own layers' adapters, and rank 0 collects whole adapters for checkpoints and exports. Context parallelism
(full fine-tuning and LoRA): the CP ranks of a replica run the same datums, each on two chunks of every
sequence (miles.train.megatron.context); the attention all-gathers K and V over CP (attention.py), the
logprobs are gathered back into sequence order so every loss runs on whole sequences, megatron's DDP (and
LoRA's optimizer) sums the gradients over data x context parallel ranks, and only CP rank 0 of the first
replica pushes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file, save_file

from miles.contract.layout import gpu_problems, model_problems, train_mode_problems
from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape
from miles.errors import UserError
from miles.train.backends import optim
from miles.train.backends.base import ShardedWeights
from miles.train.backends.compute import forward_backward_output
from miles.train.dist import DistContext, gather_shares, local_share
from miles.train.megatron.context import ContextSplit
from miles.train.megatron.state_layout import STATE_FORMAT, running_layout, state_layout_problem
from miles.train.preflight import preflight
from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec

if TYPE_CHECKING:  # megatron-core is imported when a backend starts, never when this module loads
    from miles.train.megatron.lora_trainer import MegatronLoraTrainer
    from miles.train.megatron.pipeline_weights import PipelinePushSource
    from miles.train.megatron.push import TpPushSource

FULL_KEY = "full"
STATE_META = "miles_state.json"
EXPORT_SHARD_BYTES = 2 << 30  # HF export: one safetensors file per 2 GiB, so rank 0 holds one at a time
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class MegatronBackend(ShardedWeights):
    def __init__(
        self,
        model_path: str,
        *,
        train_mode: str,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        dist: DistContext | None = None,
        parallel: Mapping[str, Any] | None = None,
        max_tokens_per_micro_batch: int = 16384,
        max_batch_tokens: int | None = None,
        seed: int = 0,
    ) -> None:
        if train_mode not in ("full", "lora"):
            raise UserError(f"train_mode must be 'lora' or 'full', got {train_mode!r}")
        self.train_mode = train_mode
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_tokens = max_tokens_per_micro_batch
        self.max_batch_tokens = max_batch_tokens
        self.shape = ModelShape.from_model_dir(model_path)
        self.vocab_size = self.shape.vocab_size
        self.max_context = self.shape.max_position_embeddings
        self.layout = ParallelLayout(**(parallel or {}))
        world = dist.world_size if dist is not None else 1
        # not the context length against 2 x context: each micro-batch is padded to it, whatever the model's
        # max_position_embeddings (the preset's max_context is checked when it loads)
        problems = gpu_problems(self.layout, world) + model_problems(self.layout, self.shape)
        problems += train_mode_problems(self.layout, train_mode)
        if problems:
            raise UserError("; ".join(problems))
        self._pipelined = self.layout.pipeline > 1
        self._start(seed)

    def _start(self, seed: int) -> None:
        from megatron.core import parallel_state

        from miles.train.megatron import model as mcore
        from miles.train.megatron import optim_state

        if self.device.type == "cpu":  # development and CI: megatron-core's few CUDA requests redirected
            from miles.train.megatron.cpu import run_on_cpu

            run_on_cpu()
        _ensure_process_group(self.device)
        if self.device.type == "cuda" and self.device.index is not None:  # plain "cuda": the current one
            torch.cuda.set_device(self.device)
        mcore.init_parallel(self.layout, seed)
        self._ps = parallel_state
        self._split: ContextSplit | None = None
        if self.layout.context > 1:
            from miles.train.megatron.attention import context_split

            self._split = context_split()
        if self._pipelined:
            from miles.train.megatron import pipeline

            gpt = pipeline.build_stage_gpt(self.shape, self.layout, self.dtype).to(self.device)
        else:
            gpt = mcore.build_gpt(self.shape, self.layout, self.dtype).to(self.device)
        self._load_checkpoint_weights(gpt)
        gpt.eval()  # no dropout anywhere; ranks stay identical
        self._gpt = gpt
        self._pad = pad_multiple(self.layout)
        self._lora: MegatronLoraTrainer | None = None
        if self.train_mode == "lora":  # a frozen base, no megatron DDP or optimizer: each adapter has its own
            self._start_lora()
            return
        self.ddp = optim_state.wrap_ddp(gpt)
        self.optimizer = optim_state.build_optimizer(self.ddp, self.dtype)
        self._stepped = False  # Adam state exists only after the first step (save_state records it)

    def _load_checkpoint_weights(self, gpt: torch.nn.Module) -> None:
        """The HF checkpoint's weights: this rank's TP shards (of its pipeline stage's tensors)."""
        from miles.train.megatron import model as mcore

        if self._pipelined:
            from miles.train.megatron import pipeline

            pipeline.load_stage_weights(gpt, self.model_path, self.shape)
            return
        mcore.load_hf_weights(gpt, self.model_path, self.shape)

    def _start_lora(self) -> None:
        from miles.train.megatron.lora import MegatronLoraAdapters
        from miles.train.megatron.lora_trainer import MegatronLoraTrainer

        adapters = MegatronLoraAdapters(self._gpt, self.shape, self.model_path, self.device)
        # the adapters' gradients are summed over data x context parallel ranks (each CP rank holds its
        # tokens' share), as megatron's DDP sums the full model's
        self._lora = MegatronLoraTrainer(adapters, self._dp_cp(), self.device)

    # ---- model keys (LoRA: named adapters on the frozen base; full: one model every key names) -------

    def _require_lora(self, what: str) -> MegatronLoraTrainer:
        if self._lora is None:
            raise UserError(f"{what} needs a LoRA trainer; this megatron trainer trains the full model")
        return self._lora

    def create_adapter(self, key: str, spec: LoraSpec) -> None:
        self._require_lora("create_adapter").adapters.create(key, spec)

    def remove_adapter(self, key: str) -> None:
        self._require_lora("remove_adapter").adapters.remove(key)

    def has_adapter(self, key: str) -> bool:
        return self._lora is not None and self._lora.adapters.has(key)

    def model_keys(self) -> list[str]:
        return self._lora.adapters.keys() if self._lora is not None else [FULL_KEY]

    @property
    def gpt(self) -> torch.nn.Module:
        return self._gpt

    @property
    def lora(self) -> MegatronLoraTrainer | None:
        return self._lora

    def named_trainable_parameters(self, key: str) -> list[tuple[str, torch.nn.Parameter]]:
        """megatron names, this rank's TP shards (LoRA: `module.lora_A/B.weight` of adapter `key`)."""
        if self._lora is not None:
            return self._lora.adapters.get(key).named_parameters()
        return list(self.gpt.named_parameters())

    # ---- training ---------------------------------------------------------------------------------

    def _dp(self) -> DistContext:
        ps = self._ps
        return DistContext(
            ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()
        )

    def _dp_cp(self) -> DistContext:
        ps = self._ps
        return DistContext(
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_data_parallel_world_size(with_context_parallel=True),
            ps.get_data_parallel_group(with_context_parallel=True),
        )

    def forward_backward(
        self,
        key: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_config: Mapping[str, float],
        forward_only: bool = False,
    ) -> ForwardBackwardOutput:
        from miles.train.megatron.compute import run_datums

        if self._pipelined:
            from miles.train.megatron.pipeline import run_datums

        checked = preflight(
            data,
            loss_fn,
            loss_config,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            max_batch_tokens=self.max_batch_tokens,
        )
        dp = self._dp()
        if self._lora is not None:
            self._lora.activate(key)
            model, output_delta = self.gpt, self._lora.adapters.output_delta()
        else:
            model, output_delta = self.ddp, None
        results = run_datums(
            model,
            local_share(data, dp),
            checked.loss,
            checked.loss_config,
            device=self.device,
            backward=not forward_only,
            max_tokens=self.max_tokens,
            pad_multiple=self._pad,
            output_delta=output_delta,
            split=self._split,
        )
        return forward_backward_output(gather_shares(results, dp))

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        from miles.train.megatron import optim_state

        if self._lora is not None:
            return self._lora.optim_step(key, adam)
        optim.validate_adam(adam)
        grad_norm = optim_state.step(self.optimizer, self.ddp, adam)
        self._stepped = True
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": adam.learning_rate}

    # ---- a replica beside the core (a hybrid lane, issue 38): full fine-tuning at TP 1 ----------------

    def _replica_parts(self, what: str) -> list[tuple[str, torch.nn.Parameter]]:
        if self._lora is not None:
            raise UserError(f"{what} is for full fine-tuning; LoRA adapters are copied whole")
        if (self.layout.tensor, self.layout.pipeline, self.layout.context) != (1, 1, 1):
            raise UserError(f"{what} needs tensor, pipeline and context parallel sizes of 1 (hybrid lanes)")
        return list(self.gpt.named_parameters())

    def whole_optimizer_state(self) -> dict[str, Any] | None:
        """Every parameter's fp32 main weights, Adam moments and step, gathered over the DP group onto DP
        rank 0 (None on the others): what a replica of another DP size is built from (zero_state.py)."""
        from miles.train.megatron import zero_state

        return zero_state.gather_whole(
            self.optimizer, self._replica_parts("whole_optimizer_state"), self._dp()
        )

    def load_whole_optimizer_state(self, whole: Mapping[str, Any]) -> None:
        """Take this rank's ranges of `whole` (whole_optimizer_state's, from any DP size); the bf16 weights
        follow from the main ones. Every DP rank passes the same `whole`."""
        from miles.train.megatron import zero_state

        zero_state.load_whole(
            self.optimizer, self.ddp, self._replica_parts("load_whole_optimizer_state"), whole
        )
        self._stepped = any(state.step is not None for state in whole.values())

    def gradient_buffers(self) -> list[torch.Tensor]:
        """Each parameter's fp32 gradient (megatron's `main_grad`, a view of its DDP buffer), in parameter
        order: what the replicas sum in place."""
        return [param.main_grad for _, param in self._replica_parts("gradient_buffers")]

    def data_parallel(self) -> DistContext:
        """This rank's data-parallel group (the distributed optimizer's)."""
        return self._dp()

    def drop_gradients(self) -> None:
        """Forget the gradients accumulated since the last step (a hybrid step to be recomputed)."""
        self._replica_parts("drop_gradients")
        self.ddp.zero_grad_buffer()

    def step_summed(self, adam: AdamParams, grad_norm: float) -> dict[str, float]:
        """optim_step on the gradient the caller summed over every replica (the core's DP ranks and the
        lanes) into gradient_buffers, clipped by `grad_norm` measured once by the caller: no DP reduction
        here."""
        from miles.train.megatron import replica_grads

        optim.validate_adam(adam)
        named = self._replica_parts("step_summed")
        replica_grads.step_summed(self.optimizer, self.ddp, named, adam, grad_norm)
        self._stepped = True
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": adam.learning_rate}

    def reset(self, key: str) -> None:
        """The checkpoint's weights again, a fresh Adam and no pending gradients."""
        from miles.train.megatron import optim_state

        if self._lora is not None:
            self._lora.reset(key)
            return
        self._load_checkpoint_weights(self.gpt)
        self.ddp.zero_grad_buffer()
        optim_state.reset(self.optimizer)
        self._stepped = False

    # ---- state: per TP rank weights, per TP x DP rank optimizer --------------------------------------

    def _ranks(self) -> tuple[int, int]:
        return self._ps.get_tensor_model_parallel_rank(), self._ps.get_data_parallel_rank()

    def _optimizer_tag(self) -> str:
        """The optimizer shard a state file holds: the distributed optimizer shards over data x context
        parallel ranks, so under CP each CP rank has its own (`-cp{c}`)."""
        _, dp_rank = self._ranks()
        cp = f"-cp{self._ps.get_context_parallel_rank()}" if self.layout.context > 1 else ""
        return f"{self._model_rank_tag()}{cp}-dp{dp_rank}"

    def _model_rank_tag(self) -> str:
        """`tp{k}`, and `-pp{s}` under pipeline parallelism: the model shard a state file holds."""
        tag = f"tp{self._ps.get_tensor_model_parallel_rank()}"
        return f"{tag}-pp{self._ps.get_pipeline_model_parallel_rank()}" if self._pipelined else tag

    def save_state(self, key: str, path: Path, *, with_optimizer: bool) -> None:
        from miles.train.megatron import optim_state

        if self._lora is not None:  # whole tensors in PEFT names: any layout (and backend) resumes them
            self._lora.save_state(key, path, with_optimizer=with_optimizer)
            return
        path = Path(path)
        tag = self._model_rank_tag()
        path.mkdir(parents=True, exist_ok=True)
        if self._ps.get_data_parallel_rank(with_context_parallel=True) == 0:  # CP ranks hold the same weights
            tensors = {n: p.detach().to("cpu").contiguous() for n, p in self.gpt.named_parameters()}
            save_file(tensors, str(path / f"weights-{tag}.safetensors"))
        saved_optimizer = with_optimizer and self._stepped
        if saved_optimizer:
            optim_state.save(self.optimizer, path / f"optimizer-{self._optimizer_tag()}")
        if torch_dist.get_rank() == 0:
            meta = {
                "format": STATE_FORMAT,
                "backend": "megatron",
                "train_mode": self.train_mode,
                "tensor": self.layout.tensor,
                "pipeline": self.layout.pipeline,
                "context": self.layout.context,
                "data": self._ps.get_data_parallel_world_size(),
                "has_optimizer": saved_optimizer,
                "optimizer_empty": with_optimizer and not self._stepped,
            }
            (path / STATE_META).write_text(json.dumps(meta, indent=2) + "\n")
        torch_dist.barrier()  # every rank's files are written when the command returns

    def load_state(self, key: str, path: Path, *, with_optimizer: bool) -> None:
        from miles.train.megatron import optim_state

        if self._lora is not None:
            self._lora.load_state(key, path, with_optimizer=with_optimizer, create=self.create_adapter)
            return
        path = Path(path)
        meta = self._read_state_meta(path)
        moves_optimizer = with_optimizer and meta.get("has_optimizer")
        if not moves_optimizer and with_optimizer and not meta.get("optimizer_empty"):
            raise UserError(
                f"checkpoint {path} was saved without optimizer state; load it without the optimizer"
            )
        # checked on every rank before anything changes: the same refusal everywhere, the model untouched
        self._check_state_layout(path, meta, optimizer=bool(moves_optimizer))
        tensors = load_file(str(path / f"weights-{self._model_rank_tag()}.safetensors"))
        params = dict(self.gpt.named_parameters())
        if set(tensors) != set(params):
            raise UserError(f"checkpoint {path} does not hold this model's parameters")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[name])
        self.ddp.zero_grad_buffer()
        if moves_optimizer:
            optim_state.load(self.optimizer, self.ddp, path / f"optimizer-{self._optimizer_tag()}")
            self._stepped = True
            return
        optim_state.reset(self.optimizer)
        self._stepped = False

    def _read_state_meta(self, path: Path) -> dict:
        meta_path = path / STATE_META
        if not meta_path.is_file():
            raise UserError(f"{path} is not a trainer checkpoint (no {STATE_META})")
        return json.loads(meta_path.read_text())

    def _check_state_layout(self, path: Path, meta: Mapping[str, Any], *, optimizer: bool) -> None:
        ps = self._ps
        mine = running_layout(
            self.layout.tensor, self.layout.pipeline, self.layout.context, ps.get_data_parallel_world_size()
        )
        problem = state_layout_problem(meta, mine, optimizer=optimizer)
        if problem:
            raise UserError(f"checkpoint {path} {problem}")

    # ---- weights in HF names --------------------------------------------------------------------------

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor), gathered over TP one tensor at a time; every TP rank must iterate. Under
        pipeline parallelism every rank iterates and only rank 0 receives the tensors."""
        from miles.train.megatron import model as mcore

        if self._pipelined:
            from miles.train.megatron import pipeline_weights

            return pipeline_weights.iter_hf_tensors(self.gpt, self.shape)

        return mcore.iter_hf_tensors(self.gpt, self.shape)

    def push_source(self) -> TpPushSource | PipelinePushSource:
        """This rank's part in the weight push (miles.weights.sender): HF tensors gathered over TP (and from
        later pipeline stages, sent to rank 0) bucket by bucket by the first DP replica, sent by rank 0."""
        from miles.train.megatron.push import TpPushSource

        if self._pipelined:
            from miles.train.megatron.pipeline_weights import PipelinePushSource

            return PipelinePushSource(self.gpt, self.shape)

        return TpPushSource(self.gpt, self.shape)

    def export_hf_weights(self, path: Path, deltas: Mapping[str, torch.Tensor] | None = None) -> None:
        """HF safetensors files of at most EXPORT_SHARD_BYTES each, with their index, config and tokenizer:
        rank 0 writes, every rank gathers (the gathers are collectives). `deltas` (HF name -> tensor) are
        added to the weights they name (a merged LoRA adapter)."""
        path = Path(path)
        primary = torch_dist.get_rank() == 0
        if primary:
            path.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        tensors = _plus_deltas(self.iter_hf_weights(), deltas or {})
        for index, bucket in enumerate(_buckets(tensors, EXPORT_SHARD_BYTES)):
            name = f"model-{index:05d}.safetensors"
            if primary:
                save_file({n: t.to("cpu").contiguous() for n, t in bucket}, str(path / name))
                weight_map.update(dict.fromkeys((n for n, _ in bucket), name))
        if primary:
            index_file = {"metadata": {}, "weight_map": weight_map}
            (path / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
            for item in Path(self.model_path).iterdir():
                if item.name in MODEL_FILES or item.name.startswith(("tokenizer", "special_tokens", "vocab")):
                    shutil.copy(item, path / item.name)
        torch_dist.barrier()

    def export_merged_hf_weights(self, key: str, path: Path) -> None:
        """Full fine-tuning: the model. LoRA: the base with adapter `key` merged in (no peft needed)."""
        if self._lora is None:
            self.export_hf_weights(path)
            return
        # from the spec, not the deltas: under pipeline parallelism only rank 0 holds them, and every rank
        # must refuse alike
        if self.shape.tie_embeddings and self._lora.adapters.get(key).spec.train_unembed:
            raise UserError(
                "this model ties its embeddings and the adapter trains the unembedding: a merged export "
                "would untie them; export the adapter (save_weights_for_sampler) instead"
            )
        self.export_hf_weights(path, deltas=self._lora.merged_deltas(key))

    def export_adapter(self, key: str, path: Path) -> None:
        """adapter_config.json + adapter_model.safetensors in PEFT names, as the transformers backend's."""
        self._require_lora("export_adapter").export_adapter(key, Path(path))


def pad_multiple(layout: ParallelLayout) -> int:
    """What a micro-batch's width must divide by: sequence parallelism cuts each rank's tokens over TP,
    context parallelism cuts the sequence into 2 x CP chunks."""
    multiple = layout.tensor if layout.sequence_parallel else 1
    return multiple * (2 * layout.context if layout.context > 1 else 1)


def _plus_deltas(
    tensors: Iterator[tuple[str, torch.Tensor]], deltas: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor with its delta added in the tensor's dtype, as the transformers backend merges."""
    for name, tensor in tensors:
        delta = deltas.get(name)
        yield name, tensor if delta is None else tensor + delta.to(tensor.device, tensor.dtype)


def _buckets(
    tensors: Iterator[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _ensure_process_group(device: torch.device) -> None:
    """megatron builds its groups from the default process group; a single-rank trainer (no DistContext)
    gets a private one-rank group."""
    if torch_dist.is_initialized():
        return
    store = torch_dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(minutes=10))
