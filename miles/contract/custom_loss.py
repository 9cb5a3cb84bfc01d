"""Server-side custom losses (tinker's `create_custom_loss`): the traced graph as data, and what it may call.

The SDK traces a per-datum loss `fn(logprobs, *inputs) -> (loss, metrics)` with torch.fx and sends it node by
node (`tinker.types.CustomLossGraph`). Nothing in it is executable as sent: the gateway checks its structure
and that every function, method and attribute it names is on the allow-list below (`check_program`), and the
trainer runs it with its own table of the same names (`miles.train.custom_loss`; a test holds the two equal).
A refusal names the node and what it calls.

Deliberately missing from the allow-list: anything that reads or writes outside the graph's own tensors
(I/O, devices, `.item()`), in-place methods, and functions that make tensors of a size the graph chooses
(`new_zeros(size)`, `expand`, `repeat`): every tensor a loss makes is shaped by its inputs. Indexing by
integer tensors and `gather` are out too: an index out of range on a GPU is a device-side assert that ends
the trainer process, not an error this server could answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CUSTOM_LOSS = (
    "custom"  # the forward_backward loss_fn that runs a stored loss, with loss_fn_config {"loss_id"}
)
MAX_NODES = 512
MAX_INPUTS = 16  # logprobs included, as the SDK allows
MAX_ARG_DEPTH = 8


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# What a loss may call, by the names the SDK sends. The trainer's tables are built from these same tuples.
TORCH_FUNCTIONS = _words(
    "abs amax amin clamp clip cumsum exp expm1 log log1p log_softmax logaddexp logsumexp maximum mean "
    "minimum neg nan_to_num pow reciprocal rsqrt sigmoid sign softmax sqrt square stack cat sum tanh where "
    "zeros_like ones_like full_like"
)
FUNCTIONAL = _words("relu softmax log_softmax sigmoid tanh silu mse_loss")  # torch.nn.functional.*
NN_BUILTINS = ("torch._C._nn.log_sigmoid", "torch._C._nn.softplus")  # F.logsigmoid, F.softplus
OPERATORS = _words("add sub mul truediv neg pow getitem lt le gt ge eq ne and_ or_ invert abs")
TENSOR_METHODS = _words(
    "abs add amax amin clamp clamp_max clamp_min clip cumsum detach dim div double exp expm1 flatten float "
    "log log1p log_softmax logsumexp masked_fill max maximum mean min minimum mul neg numel pow reciprocal "
    "reshape rsqrt sigmoid sign size softmax sqrt square squeeze sub sum tanh to type_as unsqueeze view "
    "where new_tensor"
)
# Qualified names, as the SDK encodes them (`operator.*`, not CPython's `_operator.*`).
ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{name}" for name in TORCH_FUNCTIONS]
    + [f"torch.nn.functional.{name}" for name in FUNCTIONAL]
    + list(NN_BUILTINS)
    + [f"operator.{name}" for name in OPERATORS]
    + ["getattr"]
)
ALLOWED_METHODS: frozenset[str] = frozenset(TENSOR_METHODS)
ALLOWED_ATTRIBUTES: frozenset[str] = frozenset({"shape", "ndim", "dtype"})
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {"float32", "float64", "bfloat16", "float16", "int64", "int32", "bool"}
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_ENCODED_KINDS = frozenset({"ref", "tuple", "dict", "slice", "ellipsis", "float", "dtype"})
_REFUSED_KINDS = {
    "device": "tensors follow logprobs' device; make them with zeros_like / new_tensor instead",
    "layout": "layouts are not part of a loss",
    "memory_format": "memory formats are not part of a loss",
}


class CustomLossRefused(ValueError):
    """A graph this server will not run; the message says which node and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossInput(_Strict):
    name: str
    rank: Literal[0, 1, 2]


class LossNode(_Strict):
    op: Literal["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"]
    name: str
    target: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossProgram(_Strict):
    """One stored loss: its name, its inputs in order (logprobs first) and its nodes in execution order."""

    name: str = Field(min_length=1, max_length=128)
    inputs: list[LossInput] = Field(min_length=1, max_length=MAX_INPUTS)
    nodes: list[LossNode] = Field(min_length=1, max_length=MAX_NODES)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys the loss reads, in the order it takes them (logprobs excluded)."""
        return tuple(item.name for item in self.inputs[1:])


def check_program(program: CustomLossProgram) -> None:
    """Raise CustomLossRefused unless `program` is a well-formed graph that calls only allowed operations."""
    _check_inputs(program)
    defined: set[str] = set()
    placeholders = [node for node in program.nodes if node.op == "placeholder"]
    if [node.name for node in placeholders] != [item.name for item in program.inputs]:
        raise CustomLossRefused(
            f"loss {program.name!r}: its placeholders {[n.name for n in placeholders]} must be its inputs "
            f"{[i.name for i in program.inputs]}, in order"
        )
    for index, node in enumerate(program.nodes):
        where = f"loss {program.name!r} node {index} ({node.name!r})"
        if not _NAME.fullmatch(node.name) or node.name in defined:
            raise CustomLossRefused(f"{where}: node names must be unique identifiers")
        if node.op == "output":
            if index != len(program.nodes) - 1:
                raise CustomLossRefused(f"{where}: the output node must be the last node")
        elif index == len(program.nodes) - 1:
            raise CustomLossRefused(f"loss {program.name!r}: the last node must be the output node")
        _check_node(node, where, defined)
        defined.add(node.name)
    _check_output(program.name, program.nodes[-1])


def _check_inputs(program: CustomLossProgram) -> None:
    names = [item.name for item in program.inputs]
    if names[0] != "logprobs" or program.inputs[0].rank == 0:
        raise CustomLossRefused(f"loss {program.name!r}: its first input must be logprobs, of rank 1 or 2")
    bad = [name for name in names if not _INPUT_NAME.fullmatch(name)]
    if bad or len(set(names)) != len(names):
        raise CustomLossRefused(
            f"loss {program.name!r}: input names must be distinct lowercase identifiers, got {names}"
        )
    if "target_tokens" in names:
        raise CustomLossRefused(f"loss {program.name!r}: target_tokens is not a loss input (logprobs is)")


def _check_node(node: LossNode, where: str, defined: set[str]) -> None:
    if node.op == "placeholder":
        if node.target != node.name or node.args or node.kwargs:
            raise CustomLossRefused(f"{where}: a placeholder names its input and takes no arguments")
        return
    if node.op in ("get_attr", "call_module"):
        raise CustomLossRefused(
            f"{where}: {node.op} {node.target!r} is not allowed; a custom loss reads only logprobs and the "
            "loss_fn_inputs it names, and calls functions, not modules"
        )
    if node.op == "call_function" and node.target not in ALLOWED_FUNCTIONS:
        raise CustomLossRefused(f"{where}: calls {node.target!r}, which is not on this server's allow-list")
    if node.op == "call_method":
        if node.target not in ALLOWED_METHODS:
            raise CustomLossRefused(
                f"{where}: calls method {node.target!r}, which is not on this server's allow-list"
            )
        if not node.args or not _is_ref(node.args[0]):
            raise CustomLossRefused(f"{where}: a method call needs the tensor it is called on")
    for value in _walk([*node.args, *node.kwargs.values()], where, depth=0):
        if _is_ref(value) and value["ref"] not in defined:
            raise CustomLossRefused(f"{where}: refers to {value['ref']!r}, which no earlier node defines")
    if node.target == "getattr" and (len(node.args) != 2 or node.args[1] not in ALLOWED_ATTRIBUTES):
        raise CustomLossRefused(
            f"{where}: reads attribute {node.args[1:]!r}; a loss may read only {sorted(ALLOWED_ATTRIBUTES)}"
        )


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"ref"} and isinstance(value["ref"], str)


def _walk(values: Sequence[Any], where: str, depth: int) -> Iterator[Any]:
    """Every encoded value under `values`, checked against the SDK's encoding; refs are yielded."""
    if depth > MAX_ARG_DEPTH:
        raise CustomLossRefused(f"{where}: arguments nest deeper than {MAX_ARG_DEPTH} levels")
    for value in values:
        if value is None or isinstance(value, bool | int | float | str):
            continue
        if isinstance(value, list):
            yield from _walk(value, where, depth + 1)
            continue
        if not isinstance(value, dict) or len(value) != 1:
            raise CustomLossRefused(f"{where}: {value!r} is not an encoded argument")
        kind, inner = next(iter(value.items()))
        if kind in _REFUSED_KINDS:
            raise CustomLossRefused(f"{where}: a {kind} argument is not allowed: {_REFUSED_KINDS[kind]}")
        if kind not in _ENCODED_KINDS:
            raise CustomLossRefused(f"{where}: unknown argument encoding {kind!r}")
        yield from _walk_encoded(kind, inner, value, where, depth)


def _walk_encoded(kind: str, inner: Any, value: Any, where: str, depth: int) -> Iterator[Any]:
    if kind == "ref":
        if not isinstance(inner, str):
            raise CustomLossRefused(f"{where}: a ref names a node, got {inner!r}")
        yield value
    elif kind in ("tuple", "slice"):
        if not isinstance(inner, list) or (kind == "slice" and len(inner) != 3):
            raise CustomLossRefused(f"{where}: a {kind} is encoded as a list, got {inner!r}")
        yield from _walk(inner, where, depth + 1)
    elif kind == "dict":
        if not isinstance(inner, dict):
            raise CustomLossRefused(f"{where}: a dict is encoded as an object, got {inner!r}")
        yield from _walk(list(inner.values()), where, depth + 1)
    elif kind == "float" and inner not in ("inf", "-inf", "nan"):
        raise CustomLossRefused(f"{where}: a float is encoded as 'inf', '-inf' or 'nan', got {inner!r}")
    elif kind == "dtype" and inner not in ALLOWED_DTYPES:
        raise CustomLossRefused(f"{where}: dtype {inner!r} is not one of {sorted(ALLOWED_DTYPES)}")
    elif kind == "ellipsis" and inner is not True:
        raise CustomLossRefused(f"{where}: an ellipsis is encoded as true")


def _check_output(name: str, node: LossNode) -> None:
    """The output is (loss, {metric key: tensor}): both refs, the keys as the SDK names them."""
    where = f"loss {name!r} output"
    if len(node.args) != 1 or node.kwargs:
        raise CustomLossRefused(f"{where}: returns one value, (loss, metrics)")
    out = node.args[0]
    pair = out.get("tuple") if isinstance(out, dict) else out
    if not isinstance(pair, list) or len(pair) != 2 or not _is_ref(pair[0]):
        raise CustomLossRefused(f"{where}: must return (loss, metrics) with the loss a tensor")
    metrics = pair[1].get("dict") if isinstance(pair[1], dict) else None
    if not isinstance(metrics, dict):
        raise CustomLossRefused(f"{where}: its metrics must be a dict")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key) or not _is_ref(value):
            raise CustomLossRefused(
                f"{where}: metric {key!r} must be a tensor keyed custom/<name>:sum or custom/<name>:mean"
            )


def output_refs(program: CustomLossProgram) -> tuple[str, dict[str, str]]:
    """(the loss's node name, {metric key: node name}) of a checked program."""
    out = program.nodes[-1].args[0]
    pair = out["tuple"] if isinstance(out, dict) else out
    return pair[0]["ref"], {key: value["ref"] for key, value in pair[1]["dict"].items()}


def program_from_request(
    name: str, inputs: Sequence[Mapping[str, Any]], graph: Mapping[str, Any]
) -> CustomLossProgram:
    """A checked program from the SDK's CreateCustomLossRequest fields (CustomLossRefused if not one)."""
    if graph.get("format", 1) != 1:
        raise CustomLossRefused(f"custom loss graph format {graph.get('format')!r} is not supported (1 is)")
    try:
        program = CustomLossProgram(name=name, inputs=list(inputs), nodes=list(graph.get("nodes") or []))
    except ValueError as exc:
        raise CustomLossRefused(f"custom loss {name!r} is malformed: {exc}") from exc
    check_program(program)
    return program
