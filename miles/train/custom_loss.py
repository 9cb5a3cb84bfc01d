"""Run a stored custom loss (miles.contract.custom_loss) on one datum, from this module's own tables.

The graph is interpreted node by node: each function and method it names is looked up in `FUNCTIONS` /
`METHODS` below, built once from the contract's allow-list (a few replaced by guarded versions), never
resolved from the name a request sends, so nothing outside these tables can run. Every tensor a node makes
is checked against a size cap, so a graph cannot grow memory past what its inputs justify. The preflight
runs the graph on meta tensors first, on every rank before any forward pass: shape errors, the cap, a loss
that is not a scalar or does not depend on logprobs are refused there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from miles.contract.custom_loss import (
    ALLOWED_ATTRIBUTES,
    ALLOWED_DTYPES,
    FUNCTIONAL,
    OPERATORS,
    TENSOR_METHODS,
    TORCH_FUNCTIONS,
    CustomLossProgram,
    CustomLossRefused,
    check_program,
    output_refs,
)
from miles.errors import UserError
from miles.types import Datum

# At most this many elements in any tensor a loss makes, or 8x its inputs' elements when that is more: room
# for a [T, T] pairwise term at T = 2048, not for a graph that doubles a tensor forty times.
MIN_ELEMENT_CAP = 1 << 22
INPUT_ELEMENT_FACTOR = 8
MAX_INT_EXPONENT = 64  # of a Python number: an int raised to a huge power stalls the trainer computing it
INT64_MAX = 2**63 - 1


def _getattr(value: Any, name: str) -> Any:
    if not isinstance(value, torch.Tensor) or name not in ALLOWED_ATTRIBUTES:
        raise UserError(f"a custom loss may read only {sorted(ALLOWED_ATTRIBUTES)} of a tensor, not {name!r}")
    return getattr(value, name)


def _getitem(value: Any, index: Any) -> Any:
    """operator.getitem with ints, slices, None, Ellipsis and boolean masks; integer-tensor indices are
    refused (out of range on a GPU they are a device-side assert that ends the process). On meta tensors (the
    preflight) a mask selects every element, the largest result it can give."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype != torch.bool:
            raise UserError(
                "a custom loss may index a tensor by ints, slices and boolean masks, not by a tensor of "
                "indices"
            )
    if isinstance(value, torch.Tensor) and value.is_meta:
        _check_mask_shapes(value, parts)
        # a mask's result has as many rows as it has true values, which a meta tensor does not know: index
        # with as many rows as the mask has elements (one index tensor per masked dimension, as torch does)
        parts = tuple(
            p
            for part in parts
            for p in (
                (torch.zeros(part.numel(), dtype=torch.long, device="meta"),) * part.ndim
                if isinstance(part, torch.Tensor)
                else (part,)
            )
        )
        return operator.getitem(value, parts)
    return operator.getitem(value, index)


def _check_mask_shapes(value: torch.Tensor, parts: tuple[Any, ...]) -> None:
    """A mask must have the shape of the dimensions it indexes (a meta run cannot let torch check it)."""
    if any(part is Ellipsis for part in parts):
        return  # where each mask lands depends on the ellipsis: torch checks it on the real run
    dim = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            covered = tuple(value.shape[dim : dim + part.ndim])
            if tuple(part.shape) != covered:
                raise UserError(
                    f"a mask of shape {list(part.shape)} cannot index dimensions {list(covered)} of a "
                    f"tensor of shape {list(value.shape)}"
                )
            dim += part.ndim
        elif part is not None:
            dim += 1


def _arithmetic(name: str) -> Callable[..., Any]:
    """operator.<name> on tensors and numbers only: on strings or lists Python's `*` repeats them, which
    a graph could use to fill the trainer's memory. A Python integer result stays within int64."""
    function = getattr(operator, name)

    def guarded(*operands: Any) -> Any:
        for operand in operands:
            if not isinstance(operand, torch.Tensor | int | float | bool):
                raise UserError(
                    f"operator.{name} in a custom loss takes tensors and numbers, not {operand!r}"
                )
        if name == "pow" and not isinstance(operands[0], torch.Tensor):
            exponent = operands[1]
            if isinstance(exponent, int) and abs(exponent) > MAX_INT_EXPONENT:
                raise UserError(
                    f"a custom loss raises a number to the power {exponent}; at most {MAX_INT_EXPONENT}"
                )
        value = function(*operands)
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise UserError(f"operator.{name} in a custom loss makes an integer beyond int64")
        return value

    return guarded


FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"torch.{name}": getattr(torch, name) for name in TORCH_FUNCTIONS},
    **{f"torch.nn.functional.{name}": getattr(F, name) for name in FUNCTIONAL},
    "torch._C._nn.log_sigmoid": F.logsigmoid,
    "torch._C._nn.softplus": F.softplus,
    **{f"operator.{name}": _arithmetic(name) for name in OPERATORS if name != "getitem"},
    "operator.getitem": _getitem,
    "getattr": _getattr,
}


def _to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Tensor.to for dtypes (or another tensor's dtype) only: a loss never moves a tensor between devices."""
    if set(kwargs) - {"dtype"} or len(args) > 1:
        raise UserError("a custom loss may call .to() only with a dtype")
    target = args[0] if args else kwargs.get("dtype")
    if isinstance(target, torch.Tensor):
        target = target.dtype
    if not isinstance(target, torch.dtype):
        raise UserError(f"a custom loss may call .to() only with a dtype, got {target!r}")
    return tensor.to(dtype=target)


METHODS: dict[str, Callable[..., Any]] = {
    **{name: getattr(torch.Tensor, name) for name in TENSOR_METHODS},
    "to": _to,
}

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ALLOWED_DTYPES}


@dataclass(frozen=True)
class CustomLossOutput:
    loss: torch.Tensor  # 0-d
    metrics: dict[str, torch.Tensor]  # 0-d each, keyed custom/<name>:sum|mean


class CustomLoss:
    """A checked program, runnable on one datum's logprobs and inputs."""

    def __init__(self, program: CustomLossProgram) -> None:
        try:
            check_program(program)
        except CustomLossRefused as exc:
            raise UserError(str(exc)) from exc
        self.program = program
        self.name = program.name
        self.ranks = {item.name: item.rank for item in program.inputs}
        self._loss_ref, self._metric_refs = output_refs(program)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CustomLoss:
        """From a forward_backward's loss config as the gateway sends it: {"program": <stored program>}."""
        raw = config.get("program")
        if set(config) != {"program"} or not isinstance(raw, Mapping | CustomLossProgram):
            raise UserError(
                "loss_fn 'custom' runs a stored loss: create it with create_custom_loss and pass its "
                "loss_fn_config {'loss_id': ...}"
            )
        try:
            program = raw if isinstance(raw, CustomLossProgram) else CustomLossProgram.model_validate(raw)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise UserError(f"the custom loss program is malformed: {exc}") from exc
        return cls(program)

    def __call__(self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> CustomLossOutput:
        cap = max(
            MIN_ELEMENT_CAP,
            INPUT_ELEMENT_FACTOR * (logprobs.numel() + sum(t.numel() for t in inputs.values())),
        )
        env: dict[str, Any] = {}
        for node in self.program.nodes:
            if node.op == "placeholder":
                env[node.name] = logprobs if node.name == "logprobs" else inputs[node.name]
            elif node.op != "output":
                env[node.name] = self._run_node(node, env, cap)
        return self._output(env)

    def _run_node(self, node: Any, env: dict[str, Any], cap: int) -> Any:
        args = [_decode(arg, env) for arg in node.args]
        kwargs = {key: _decode(value, env) for key, value in node.kwargs.items()}
        where = f"custom loss {self.name!r} node {node.name!r} ({node.target})"
        try:
            if node.op == "call_function":
                value = FUNCTIONS[node.target](*args, **kwargs)
            else:
                if not isinstance(args[0], torch.Tensor):
                    raise UserError(
                        f"{where}: a method is called on a tensor, not on {type(args[0]).__name__}"
                    )
                value = METHODS[node.target](*args, **kwargs)
        except UserError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise UserError(f"{where} failed: {exc}") from exc
        if isinstance(value, torch.Tensor) and value.numel() > cap:
            raise UserError(
                f"{where} makes a tensor of {value.numel()} elements, over this datum's cap of {cap} "
                f"(the larger of {MIN_ELEMENT_CAP} and {INPUT_ELEMENT_FACTOR}x its inputs' elements)"
            )
        return value

    def _output(self, env: Mapping[str, Any]) -> CustomLossOutput:
        loss = env[self._loss_ref]
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(
                f"custom loss {self.name!r} must return a floating-point scalar loss, got {shape}"
            )
        metrics = {}
        for key, ref in self._metric_refs.items():
            value = env[ref]
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UserError(f"custom loss {self.name!r} metric {key!r} must be a one-element tensor")
            metrics[key] = value.reshape(())
        return CustomLossOutput(loss, metrics)


def _decode(value: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(item, env) for item in value]
    if not isinstance(value, dict):
        return value
    kind, inner = next(iter(value.items()))
    if kind == "ref":
        return env[inner]
    if kind == "tuple":
        return tuple(_decode(item, env) for item in inner)
    if kind == "dict":
        return {key: _decode(item, env) for key, item in inner.items()}
    if kind == "slice":
        return slice(*(_decode(item, env) for item in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(inner)
    if kind == "dtype":
        return DTYPES[inner]
    raise UserError(f"unknown argument encoding {kind!r}")  # check_program refuses these first


def loss_dtype(dtype: np.dtype) -> torch.dtype:
    """The dtype a loss sees for a loss_fn_inputs array: floats as float32, integers as int64, bools as is."""
    if np.issubdtype(dtype, np.floating):
        return torch.float32
    return torch.bool if dtype == np.bool_ else torch.int64


def input_tensor(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A loss_fn_inputs array as the loss sees it (loss_dtype), on `device`."""
    return torch.as_tensor(array).to(device=device, dtype=loss_dtype(array.dtype))


def declared_input(loss: CustomLoss, name: str, array: np.ndarray) -> np.ndarray:
    """A datum's input in the rank the loss declared. The wire cannot say rank 0: a tensor without a shape
    arrives as [n], so a one-element array stands for a declared scalar."""
    if loss.ranks[name] == 0 and array.ndim == 1 and array.size == 1:
        return array.reshape(())
    return array


def input_problem(loss: CustomLoss, inputs: Mapping[str, Any], length: int, logprob_rank: int) -> str | None:
    """Why one datum's loss_fn_inputs do not fit the loss's declared inputs, or None. A rank-1 input is
    [T] and a rank-2 input [T, K], T the datum's target count, as the SDK documents them."""
    if logprob_rank != loss.ranks["logprobs"]:
        return (
            f"custom loss {loss.name!r} declared logprobs with rank {loss.ranks['logprobs']}, but "
            f"target_tokens has rank {logprob_rank}"
        )
    for name in loss.program.input_names:
        if name not in inputs:
            return f"custom loss {loss.name!r} reads loss_fn_inputs[{name!r}], which this datum lacks"
        if not isinstance(inputs[name], np.ndarray):
            return f"loss_fn_inputs[{name!r}] is not an array"
        array = declared_input(loss, name, inputs[name])
        rank = loss.ranks[name]
        if array.ndim != rank:
            return (
                f"loss_fn_inputs[{name!r}] has rank {array.ndim}, but custom loss {loss.name!r} declared "
                f"rank {rank}" + (" (a scalar is one value)" if rank == 0 else "")
            )
        if rank >= 1 and array.shape[0] != length:
            return f"loss_fn_inputs[{name!r}] has {array.shape[0]} rows but target_tokens has {length}"
        if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
            return f"loss_fn_inputs[{name!r}] contains NaN or infinite values"
    return None


def datum_inputs(loss: CustomLoss, datum: Datum, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors the loss reads for `datum` (which passed input_problem), on `device`."""
    return {
        name: input_tensor(declared_input(loss, name, datum.loss_fn_inputs[name]), device)
        for name in loss.program.input_names
    }


# (logprobs' shape, ((input name, shape, dtype), ...)): what the preflight's meta run of a datum depends on
MetaSignature = tuple[tuple[int, ...], tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]


def meta_signature(datum: Datum, loss: CustomLoss) -> MetaSignature:
    """The shapes and dtypes the loss sees for `datum` (which passed input_problem)."""
    inputs = datum.loss_fn_inputs
    logprob_shape = tuple(inputs["target_tokens"].shape)
    signature = []
    for name in loss.program.input_names:
        array = declared_input(loss, name, inputs[name])
        signature.append((name, tuple(array.shape), loss_dtype(array.dtype)))
    return logprob_shape, tuple(signature)


def extreme_signatures(signatures: Iterable[MetaSignature]) -> list[MetaSignature]:
    """Of the signatures that differ only in the datum's length T, the shortest and the longest: a meta run
    costs about a millisecond, and an RL batch has nearly as many lengths as datums. A graph's shape errors
    do not depend on T but through the edges (too short to slice, the size cap at the longest)."""
    families: dict[Any, list[MetaSignature]] = {}
    for signature in sorted(signatures, key=repr):  # the same order on every rank, so the same message
        logprob_shape, inputs = signature
        family = (
            logprob_shape[1:],
            tuple((name, shape[1:], len(shape), dtype) for name, shape, dtype in inputs),
        )
        families.setdefault(family, []).append(signature)
    chosen: list[MetaSignature] = []
    for members in families.values():
        members.sort(key=lambda signature: signature[0][0])
        chosen.extend(dict.fromkeys([members[0], members[-1]]))
    return chosen


def dry_run_problems(loss: CustomLoss, signatures: Sequence[MetaSignature]) -> str | None:
    """Run the loss on meta tensors of each signature; the first failure as a message, or None."""
    for logprob_shape, input_shapes in signatures:
        logprobs = torch.empty(logprob_shape, device="meta", requires_grad=True)
        inputs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in input_shapes}
        try:
            out = loss(logprobs, inputs)
        except UserError as exc:
            return str(exc)
        if not out.loss.requires_grad:
            return f"custom loss {loss.name!r} does not depend on logprobs: it would train nothing"
    return None
