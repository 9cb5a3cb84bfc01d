"""Several named LoRA adapters on one frozen base model, through peft.

Callers' keys (e.g. Tinker model ids with colons) are mapped to internal peft adapter names, so any string
works as a key. Adapter defaults: alpha = 32 when LoraSpec.alpha is None (Tinker's fixed alpha), dropout 0,
A initialised from `spec.seed` or, without a seed, from a hash of the key — every data-parallel rank must
start from the same adapter weights. train_unembed puts LoRA on `lm_head`.

Linear layers get RoutedLoraLinear (lora_layer.py): adapter weights stay fp32, their matmuls run in the
base's dtype on a bf16/fp16 base, and a mixed-adapter batch runs all adapters as one GEMM pair per layer
with a per-row block mask. LoraAdapters sets every layer's route (tensors, never adapter names, so
compiled layers do not recompile per tenant): `activate` routes through one adapter, `mixed_batch` through
the batch's adapters stacked.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save_file

from miles.contract.lora_layout import lora_targets
from miles.errors import UserError
from miles.train.backends.lora_layer import (
    LayerRoute,
    Route,
    RoutedLoraLinear,
    lora_delta,
    mark_rank_dynamic,
    mixed_route,
    mixed_rows,
    single_route,
)
from miles.types import LoraSpec

DEFAULT_LORA_ALPHA = 32.0


def lora_config(spec: LoraSpec, base_model_path: str) -> LoraConfig:
    if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
        raise UserError(f"LoRA rank must be a positive integer, got {spec.rank!r}")
    alpha = DEFAULT_LORA_ALPHA if spec.alpha is None else float(spec.alpha)
    if alpha <= 0:
        raise UserError(f"LoRA alpha must be > 0, got {spec.alpha!r}")
    targets = lora_targets(
        train_attn=spec.train_attn, train_mlp=spec.train_mlp, train_unembed=spec.train_unembed
    )
    if not targets:
        raise UserError("LoRA needs at least one of train_attn, train_mlp, train_unembed to be true")
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=base_model_path,
    )
    # peft's hook for custom LoRA layers; not a config field, so exported adapter configs stay standard
    config._register_custom_module({torch.nn.Linear: RoutedLoraLinear})
    return config


def default_compute_dtype(base: torch.nn.Module) -> torch.dtype | None:
    """The adapters' matmul dtype: the base's when it is half precision (tensor cores), else the adapters'
    own fp32."""
    dtype = next(base.parameters()).dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def init_seed(key: str, spec: LoraSpec) -> int:
    return spec.seed if spec.seed is not None else zlib.crc32(key.encode())


@dataclass
class Adapter:
    key: str
    name: str  # the peft adapter name
    spec: LoraSpec
    initial_state: dict[str, torch.Tensor]  # for reset()
    scaling: float = 1.0  # alpha / rank: every layer's, folded into the routes' scale


class LoraAdapters:
    """The peft wrapper around one base model and the adapters on it."""

    def __init__(self, base: torch.nn.Module, base_model_path: str) -> None:
        for param in base.parameters():
            param.requires_grad_(False)
        self._base = base
        self._base_model_path = base_model_path
        self._peft: PeftModel | None = None
        self._adapters: dict[str, Adapter] = {}
        self._counter = 0
        self._compute_dtype = default_compute_dtype(base)
        self._routing_state = RoutingState()

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the adapters' matmuls run in (None: the adapters' fp32); parameters stay fp32."""
        return self._compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, dtype: torch.dtype | None) -> None:
        self._compute_dtype = dtype
        for layer in self._routed_layers():
            layer.compute_dtype = dtype

    def _routed_layers(self) -> list[RoutedLoraLinear]:
        return [m for m in self._tuner_layers() if isinstance(m, RoutedLoraLinear)]

    def _tuner_layers(self) -> list[BaseTunerLayer]:
        state = self._routing_state
        if state.layers is None:
            state.layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        return state.layers

    @property
    def model(self) -> torch.nn.Module:
        return self._peft if self._peft is not None else self._base

    def keys(self) -> list[str]:
        return list(self._adapters)

    def has(self, key: str) -> bool:
        return key in self._adapters

    def get(self, key: str) -> Adapter:
        adapter = self._adapters.get(key)
        if adapter is None:
            raise UserError(f"no LoRA adapter {key!r} on this trainer (known: {sorted(self._adapters)})")
        return adapter

    def create(self, key: str, spec: LoraSpec) -> Adapter:
        if key in self._adapters:
            raise UserError(f"LoRA adapter {key!r} already exists")
        config = lora_config(spec, self._base_model_path)
        self._counter += 1
        name = f"adapter{self._counter}"
        with torch.random.fork_rng(devices=self._cuda_devices()):
            torch.manual_seed(init_seed(key, spec))
            if self._peft is None:
                self._peft = get_peft_model(self._base, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
        # new LoRA modules start in training mode: back to the base's eval mode (no dropout anywhere,
        # ranks agree; peft also refuses a mixed adapter batch in training mode)
        self._peft.eval()
        self._routing_state = RoutingState()  # new layers and parameters, peft's own active adapter
        for layer in self._routed_layers():
            layer.compute_dtype = self._compute_dtype
            layer.route = None  # peft's own routing until the next activate
        adapter = Adapter(key, name, spec, {}, self._uniform_scaling(name))
        adapter.initial_state = {k: v.detach().clone() for k, v in self.state_dict(adapter).items()}
        self._adapters[key] = adapter
        return adapter

    def _uniform_scaling(self, name: str) -> float:
        """The adapter's scaling, the same in every layer (a route folds it into one per-row scale)."""
        scalings = {layer.scaling[name] for layer in self._routed_layers() if name in layer.lora_A}
        if len(scalings) != 1:
            raise UserError(f"LoRA layers disagree on one adapter's alpha / rank: {sorted(scalings)}")
        return scalings.pop()

    def remove(self, key: str) -> None:
        adapter = self.get(key)
        assert self._peft is not None
        self._peft.delete_adapter(adapter.name)
        self._routing_state = RoutingState()
        self._set_routes([None] * len(self._routed_layers()))  # drop routes holding its parameters
        del self._adapters[key]

    def activate(self, adapter: Adapter) -> list[tuple[str, torch.nn.Parameter]]:
        """Route forwards through `adapter` only and make exactly its parameters trainable."""
        assert self._peft is not None
        state = self._routing_state
        if state.active is None:  # after a create or remove: peft's own walk sets every layer
            self._peft.set_adapter(adapter.name)
            state.trainable = None  # peft changed requires_grad too
        elif state.active != adapter.name:
            self._route_to(adapter.name)
        state.active = adapter.name
        self._make_trainable([adapter])
        self._set_routes(self._single_routes(adapter))
        return self.named_parameters(adapter)

    def _single_routes(self, adapter: Adapter) -> list[Route]:
        """Every routed layer's route through `adapter` alone (cached: the parameters stay the same)."""
        routes = self._routing_state.routes.get(adapter.name)
        if routes is None:
            scale = torch.full((1, adapter.spec.rank), adapter.scaling, device=self._device())
            routes = [single_route(layer, adapter.name, scale) for layer in self._routed_layers()]
            for route in routes:
                if isinstance(route, LayerRoute):
                    mark_rank_dynamic(route)
            self._routing_state.routes[adapter.name] = routes
        return routes

    def _set_routes(self, routes: Sequence[Route | None]) -> None:
        for layer, route in zip(self._routed_layers(), routes, strict=True):
            layer.route = route

    def activate_many(self, adapters: Sequence[Adapter]) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Make exactly these adapters' parameters trainable (one row of a mixed batch each uses one of
        them, see `mixed_batch`); their parameters, per adapter."""
        assert self._peft is not None
        self._make_trainable(adapters)
        return [self.named_parameters(adapter) for adapter in adapters]

    def _route_to(self, name: str) -> None:
        """What peft's set_adapter does to the routing, without its walk over every module and parameter
        (about 20 ms a call on the Qwen3-0.6B shape's 4,000 modules, paid by every tenant's call): each LoRA
        layer's active adapter list, and the wrappers' active adapter name."""
        assert self._peft is not None
        for layer in self._tuner_layers():
            layer._active_adapter = [name]
        self._peft.base_model.active_adapter = name
        self._peft.active_adapter = name

    def _make_trainable(self, adapters: Sequence[Adapter]) -> None:
        """Exactly these adapters' parameters require gradients: only what changed is toggled."""
        assert self._peft is not None
        state = self._routing_state
        wanted = frozenset(adapter.name for adapter in adapters)
        if state.trainable == wanted:
            return
        if state.trainable is None:
            params = {id(p) for adapter in adapters for _, p in self.named_parameters(adapter)}
            for param in self._peft.parameters():
                param.requires_grad_(id(param) in params)
        else:
            by_name = {adapter.name: adapter for adapter in self._adapters.values()}
            for name in state.trainable - wanted:
                for _, param in self.named_parameters(by_name[name]):
                    param.requires_grad_(False)
            for adapter in adapters:
                for _, param in self.named_parameters(adapter):
                    param.requires_grad_(True)
        state.trainable = wanted

    @contextmanager
    def mixed_batch(self, adapter_names: Sequence[str]) -> Iterator[None]:
        """Forwards inside route row i of every LoRA layer's input through adapter `adapter_names[i]`, so
        each adapter's gradient is the one it would get alone. One scaled block mask for the batch serves
        every layer; each layer's adapters are stacked once here (RoutedLoraLinear.route: tensors only, so
        compiled layers reuse one graph for any adapters and rows). Afterwards the layers route through
        the active adapter again (or none)."""
        assert self._peft is not None
        self._set_routes(self._mixed_routes(adapter_names))
        try:
            yield
        finally:
            active = self._by_name().get(self._routing_state.active or "")
            layers = len(self._routed_layers())
            self._set_routes(self._single_routes(active) if active is not None else [None] * layers)

    def _by_name(self) -> dict[str, Adapter]:
        return {adapter.name: adapter for adapter in self._adapters.values()}

    def _mixed_routes(self, adapter_names: Sequence[str]) -> list[Route]:
        """Every routed layer's route for a batch whose row i goes through adapter `adapter_names[i]`."""
        by_name = self._by_name()
        unknown = sorted(set(adapter_names) - set(by_name))
        if unknown:
            raise ValueError(f"rows name adapters that do not exist: {unknown} (known: {sorted(by_name)})")
        ranks = {name: by_name[name].spec.rank for name in set(adapter_names)}
        mixed = mixed_rows(adapter_names, ranks, dtype=torch.float32, device=self._device())
        columns = [by_name[name].scaling for name in mixed.adapters for _ in range(ranks[name])]
        scale = mixed.mask * torch.tensor(columns, device=mixed.mask.device)
        routes = [mixed_route(layer, mixed, scale) for layer in self._routed_layers()]
        for route in routes:
            if isinstance(route, LayerRoute):
                mark_rank_dynamic(route)
        return routes

    def _device(self) -> torch.device:
        return next(self._base.parameters()).device

    def head_for(self, adapter: Adapter) -> torch.nn.Module:
        """The unembedding as `adapter` alone sees it, callable outside `mixed_batch` (an activation
        checkpoint recomputes it during backward)."""
        assert self._peft is not None
        return AdapterHead(self._peft.get_output_embeddings(), adapter.name)

    def named_parameters(self, adapter: Adapter) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter's parameters under stable names that do not mention the internal adapter name."""
        assert self._peft is not None
        cached = self._routing_state.params.get(adapter.name)
        if cached is None:
            marker = f".{adapter.name}."
            cached = [
                (name.replace(marker, "."), param)
                for name, param in self._peft.named_parameters()
                if marker in name and ".lora_" in name
            ]
            self._routing_state.params[adapter.name] = cached
        return list(cached)

    def state_dict(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        """peft's own naming (what PeftModel.from_pretrained reads)."""
        assert self._peft is not None
        return get_peft_model_state_dict(self._peft, adapter_name=adapter.name, save_embedding_layers=False)

    def load_state_dict(self, adapter: Adapter, state: dict[str, torch.Tensor]) -> None:
        assert self._peft is not None
        expected = set(self.state_dict(adapter))
        if set(state) != expected:
            raise UserError(
                f"checkpoint tensors do not match adapter {adapter.key!r}: "
                f"missing {sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}"
            )
        result = set_peft_model_state_dict(self._peft, state, adapter_name=adapter.name)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise UserError(f"checkpoint has tensors the adapter lacks: {unexpected[:3]}")

    def export(self, adapter: Adapter, path: Path) -> None:
        """A standard PEFT directory: adapter_config.json + adapter_model.safetensors."""
        assert self._peft is not None
        path.mkdir(parents=True, exist_ok=True)
        config = self._peft.peft_config[adapter.name]
        config.save_pretrained(str(path))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict(adapter).items()}
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})

    def merged_weights(
        self, adapter: Adapter, to_hf_name: Callable[[str], str | None]
    ) -> tuple[dict[str, torch.Tensor], set[str]]:
        """(every base weight under its HF name with `adapter`'s delta added, the names it changed), on
        the CPU as separate tensors (tied weights are copies, so safetensors can write them)."""
        assert self._peft is not None
        merged = {name: t.detach().to("cpu").clone() for name, t in self.iter_base_weights(to_hf_name)}
        touched: set[str] = set()
        with torch.no_grad():
            for module_name, module in self._peft.named_modules():
                if not isinstance(module, LoraLayer) or adapter.name not in module.lora_A:
                    continue
                name = to_hf_name(f"{module_name}.base_layer.weight")
                if name is None or name not in merged:
                    raise UserError(f"cannot merge LoRA module {module_name}: no base weight {name!r}")
                delta = module.get_delta_weight(adapter.name).to("cpu", merged[name].dtype)
                merged[name] += delta
                touched.add(name)
        return merged, touched

    def iter_base_weights(self, to_hf_name: Callable[[str], str | None]):
        """Base weights under HF names (LoRA deltas excluded: adapters travel as PEFT directories)."""
        for name, tensor in self.model.state_dict().items():
            hf_name = to_hf_name(name)
            if hf_name is not None:
                yield hf_name, tensor.detach()

    def _cuda_devices(self) -> list[torch.device]:
        device = self._device()
        return [device] if device.type == "cuda" else []


@dataclass
class RoutingState:
    """What LoraAdapters knows of peft's routing, so that switching adapters touches only what changes.
    Parameters, layers and peft's own active adapter change only in create/remove, which start afresh
    (None: unknown, walk the model); loading weights copies into the parameters, which stay the same."""

    active: str | None = None  # the adapter every layer routes through, None: unknown
    trainable: frozenset[str] | None = None  # the adapters whose parameters require grad, None: unknown
    layers: list[BaseTunerLayer] | None = None
    params: dict[str, list[tuple[str, torch.nn.Parameter]]] = field(default_factory=dict)
    routes: dict[str, list[Route]] = field(default_factory=dict)  # each adapter's single routes


class AdapterHead(torch.nn.Module):
    """lm_head through one named adapter: the base projection plus that adapter's delta, as peft's LoRA
    Linear computes it for its active adapter (the base alone when the adapter leaves lm_head frozen)."""

    def __init__(self, head: torch.nn.Module, adapter_name: str) -> None:
        super().__init__()
        self.head = head
        self.adapter_name = adapter_name

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        head, name = self.head, self.adapter_name
        if not isinstance(head, LoraLayer):
            return head(hidden)
        result = head.base_layer(hidden)
        if name not in head.lora_A:
            return result
        return result + lora_delta(head, name, hidden, getattr(head, "compute_dtype", None)).to(result.dtype)


def peft_to_hf_name(name: str) -> str | None:
    """`base_model.model.X.base_layer.weight` -> `X.weight`; LoRA tensors -> None."""
    if ".lora_" in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def spec_to_json(spec: LoraSpec) -> str:
    return json.dumps(asdict(spec))


def spec_from_json(text: str) -> LoraSpec:
    return LoraSpec(**json.loads(text))
