"""SGLang's HTTP contract read from its own source, and a check of a newer SGLang against ours.

SGLang's route table comes from `srt/entrypoints/http_server.py` parsed with `ast` (its modules do not import
on CPU): every `@app.<method>(path)` / `@app.api_route(path, methods=[...])` decorator, `app.add_api_route`
call and `app.include_router(router)` of a router declared in another sglang module (its `APIRouter`
prefix and the include's `prefix=` applied). Routes registered under an `if` (or in a function) and paths
read from the environment carry a note saying so. Request bodies are the io_struct class each handler
takes as `obj`, with its fields from `srt/managers/io_struct.py`.

The committed snapshot (tests/fast/engines/sglang_contract.json) holds, for the pinned SGLang, the whole
route table, the routes SGLangApiClient sends (with the body keys and query parameters it sends) and the
routes the CPU engine serves, and the io_struct fields of every body the client sends.
tests/fast/engines/test_sglang_routes.py keeps it equal to what the installed wheel and our code give.

    python tools/sglang_contract.py [--sglang-root DIR/sglang] --compare SNAPSHOT [--write]

`--compare` prints what changed between the snapshot and the SGLang at `--sglang-root` (default: the
installed one) and exits 1 when a route, method, body field or query parameter the client or the CPU engine
relies on is gone. `--write` then rewrites the snapshot from that SGLang and our current code
(`make sglang-contract [SGLANG_VERSION=x.y.z]` runs it on a wheel installed on the side).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"
# decorator / method name -> the HTTP methods it registers (api_route and add_api_route read `methods=`)
METHOD_DECORATORS = {
    "get": "GET",
    "post": "POST",
    "put": "PUT",
    "delete": "DELETE",
    "patch": "PATCH",
    "head": "HEAD",
    "options": "OPTIONS",
    "websocket": "WEBSOCKET",
}
NO_DEFAULT = object()


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: str
    params: tuple[str, ...]  # the handler's parameter names (query parameters among them)
    # the class its `obj` parameter is annotated with: SGLang's name for io_struct bodies
    body_type: str | None
    note: str | None  # registered only under a condition, or its path comes from the environment

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class FieldSpec:
    annotation: str
    default: Any  # NO_DEFAULT when required; a literal, else None for a computed default


# ----- reading modules ---------------------------------------------------------------------------------


def _tree(file: Path) -> ast.Module:
    return _parse(file.read_text(), str(file))


@cache  # by content: one parse per file a run, and a file changed in between is read again
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _module_file(root: Path, module: str) -> Path | None:
    """`sglang.srt.x.y` -> root/srt/x/y.py (or its package's __init__.py); None outside sglang."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _absolute(root: Path, file: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = file.parent.relative_to(root.parent).parts
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _imports(root: Path, file: Path) -> dict[str, str]:
    """Local name -> dotted origin, for every import in the module (SGLang imports routers mid-file)."""
    names: dict[str, str] = {}
    for node in ast.walk(_tree(file)):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(root, file, node)
            names.update({a.asname or a.name: f"{module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):  # `import a.b as c` binds c to a.b; `import a.b` binds a to a
            names.update({a.asname: a.name for a in node.names if a.asname})
            names.update({a.name.split(".")[0]: a.name.split(".")[0] for a in node.names if not a.asname})
    return names


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _argument(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """A call's argument given by position or by name."""
    return call.args[index] if len(call.args) > index else _keyword(call, name)


def _receivers(tree: ast.Module, kinds: tuple[str, ...]) -> dict[str, str]:
    """Module-level names bound to `FastAPI(...)` / `APIRouter(...)` -> the prefix they declare."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and _call_name(node.value) in kinds:
            assert isinstance(node.value, ast.Call)
            prefix = _keyword(node.value, "prefix")
            text = prefix.value if isinstance(prefix, ast.Constant) else ""
            found.update({t.id: str(text) for t in node.targets if isinstance(t, ast.Name)})
    return found


def _module_values(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `NAME = expr` (SGLang keeps some paths in variables)."""
    return {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _path(expr: ast.expr, values: Mapping[str, ast.expr]) -> tuple[str, str | None]:
    """A route's path and a note when it is not a literal (SGLang reads some from the environment)."""
    if isinstance(expr, ast.Name) and expr.id in values:
        expr = values[expr.id]
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value, None
    if isinstance(expr, ast.Call) and ast.unparse(expr.func) in ("os.environ.get", "os.getenv") and expr.args:
        variable = ast.unparse(expr.args[0]).strip("'\"")
        default = expr.args[1] if len(expr.args) > 1 else None
        if isinstance(default, ast.Constant) and isinstance(default.value, str):
            return default.value, f"path read from ${variable}, this is its default"
        return f"<${variable}>", f"path read from ${variable}"
    return f"<{ast.unparse(expr)}>", "path not a literal"


def _methods(call: ast.Call, attr: str) -> list[str]:
    if attr in METHOD_DECORATORS:
        return [METHOD_DECORATORS[attr]]
    listed = _keyword(call, "methods")
    if listed is None:
        return ["GET"]  # FastAPI's default for api_route / add_api_route
    return sorted(str(m.upper()) for m in ast.literal_eval(listed))


def _condition(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    """What registering `node` depends on: the enclosing `if` tests (negated in `else`) and functions."""
    conditions = []
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If):
            test = ast.unparse(parent.test)
            conditions.append(test if child in parent.body else f"not ({test})")
        elif isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
            conditions.append(f"{parent.name}() runs")
        child, parent = parent, parents.get(parent)
    return " and ".join(reversed(conditions)) or None


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def _handler_facts(handler: ast.AST | None) -> tuple[str, tuple[str, ...], str | None]:
    if not isinstance(handler, ast.FunctionDef | ast.AsyncFunctionDef):
        return (ast.unparse(handler) if handler is not None else "?"), (), None
    args = handler.args
    params = tuple(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
    obj = next((a for a in args.args if a.arg == "obj" and a.annotation is not None), None)
    body_type = None
    if obj is not None:
        assert obj.annotation is not None
        names = [n.id for n in ast.walk(obj.annotation) if isinstance(n, ast.Name) and n.id[0].isupper()]
        body_type = next((n for n in names if n not in ("Annotated", "Body", "Optional", "Union")), None)
    return handler.name, params, body_type


# ----- the route table ---------------------------------------------------------------------------------


def _decorated(
    tree: ast.Module, receivers: Mapping[str, str], parents: dict[ast.AST, ast.AST]
) -> Iterator[Route]:
    values = _module_values(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        name, params, body_type = _handler_facts(node)
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args):
                continue
            receiver, attr = ast.unparse(deco.func.value), deco.func.attr
            if receiver not in receivers or (attr not in METHOD_DECORATORS and attr != "api_route"):
                continue
            path, path_note = _path(deco.args[0], values)
            note = _join(_condition(node, parents), path_note)
            for method in _methods(deco, attr):
                yield Route(method, receivers[receiver] + path, name, params, body_type, note)


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _registered(
    root: Path, file: Path, receivers: Mapping[str, str], parents: dict[ast.AST, ast.AST]
) -> Iterator[Route]:
    """Routes added by calls: `app.add_api_route(path, endpoint, methods=...)`, `app.include_router(r)`."""
    tree = _tree(file)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, attr = ast.unparse(node.func.value), node.func.attr
        if receiver not in receivers:
            continue
        note = _condition(node, parents)
        path_arg = _argument(node, 0, "path")
        if attr == "add_api_route" and path_arg is not None:
            path, path_note = _path(path_arg, _module_values(tree))
            endpoint = _argument(node, 1, "endpoint")
            target = _functions(tree).get(ast.unparse(endpoint)) if endpoint is not None else None
            name, params, body_type = _handler_facts(target or endpoint)
            for method in _methods(node, attr):
                full = receivers[receiver] + path
                yield Route(method, full, name, params, body_type, _join(note, path_note))
        router = _argument(node, 0, "router")
        if attr == "include_router" and router is not None:
            prefix = _keyword(node, "prefix")
            outer = receivers[receiver] + (prefix.value if isinstance(prefix, ast.Constant) else "")
            for route in _included(root, file, router, outer):
                yield replace(route, note=_join(note, route.note))


def _included(root: Path, file: Path, router: ast.expr, prefix: str) -> list[Route]:
    """The routes of a router passed to include_router: one of this module's, or imported from sglang."""
    local = _receivers(_tree(file), ("APIRouter",))
    name = ast.unparse(router)
    if name in local:
        return routes_of(root, file, {name: prefix + local[name]})
    origin = _imports(root, file).get(name.split(".")[0], "")
    dotted = origin + name[len(name.split(".")[0]) :]  # `mod.router` with `mod` imported
    module, _, attr = dotted.rpartition(".")
    source = _module_file(root, module) if module else None
    if source is None:
        return [Route("?", f"<router {name}>", name, (), None, "router not found in sglang's source")]
    declared = _receivers(_tree(source), ("APIRouter",))
    return routes_of(root, source, {attr: prefix + declared.get(attr, "")})


def routes_of(root: Path, file: Path, receivers: Mapping[str, str] | None = None) -> list[Route]:
    """Every route registered on `receivers` (name -> prefix; default: the module's FastAPI apps)."""
    tree = _tree(file)
    receivers = receivers if receivers is not None else _receivers(tree, ("FastAPI",))
    parents = _parents(tree)
    return [*_decorated(tree, receivers, parents), *_registered(root, file, receivers, parents)]


def sglang_routes(root: Path) -> list[Route]:
    """SGLang's HTTP server routes; `root` is the sglang package directory (installed or unpacked)."""
    return sorted(set(routes_of(root, root / HTTP_SERVER)), key=lambda r: (r.path, r.method, r.handler))


def route_table(routes: Iterable[Route]) -> dict[str, set[str]]:
    """Path -> the methods it answers."""
    table: dict[str, set[str]] = defaultdict(set)
    for route in routes:
        table[route.path].add(route.method)
    return dict(table)


def missing_routes(
    needed: Iterable[str], table: Mapping[str, set[str]], who: str, server: str = "SGLang"
) -> list[str]:
    """A message per "METHOD /path" in `needed` that `table` does not answer (path gone or method not)."""
    problems = []
    for key in sorted(set(needed)):
        method, path = key.split(" ", 1)
        if path not in table:
            problems.append(f"{key}: {who} uses it, {server} has no {path} route")
        elif method not in table[path]:
            methods = " ".join(sorted(table[path]))
            problems.append(f"{key}: {who} uses {method}, {server}'s {path} answers only {methods}")
    return problems


def route_body_types(root: Path) -> dict[str, str]:
    """Path -> the io_struct class its handler in http_server.py takes as `obj`."""
    return {r.path: r.body_type for r in sglang_routes(root) if r.body_type and r.method in ("POST", "PUT")}


# ----- io_struct fields --------------------------------------------------------------------------------


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return NO_DEFAULT
    if _call_name(value) == "field":  # dataclasses.field / msgspec.field: required without a default
        assert isinstance(value, ast.Call)
        given = _keyword(value, "default")
        if given is None:
            return None if _keyword(value, "default_factory") is not None else NO_DEFAULT
        value = given
    try:
        return ast.literal_eval(value)
    except ValueError:
        return None


def io_struct_fields(root: Path, name: str) -> dict[str, FieldSpec]:
    """The annotated fields of an io_struct class, its io_struct bases' first (as msgspec orders them)."""
    classes = {n.name: n for n in _tree(root / IO_STRUCT).body if isinstance(n, ast.ClassDef)}
    node = classes[name]
    fields: dict[str, FieldSpec] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(io_struct_fields(root, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            if not annotation.startswith("ClassVar"):
                fields[stmt.target.id] = FieldSpec(annotation, _default(stmt.value))
    return fields


def sglang_version(root: Path) -> str:
    """`__version__` of sglang/_version.py, else the dist-info next to the package, else "unknown"."""
    generated = root / "_version.py"
    if generated.is_file():
        for node in _tree(generated).body:
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if "__version__" in targets and isinstance(node, ast.Assign):
                return str(ast.literal_eval(node.value))
    for meta in sorted(root.parent.glob(f"{root.name}-*.dist-info/METADATA")):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def installed_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed: `make sglang-parser`, or pass --sglang-root DIR/sglang")
    return Path(next(iter(spec.submodule_search_locations)))


# ----- the contract ------------------------------------------------------------------------------------


def build_contract(
    root: Path, client: Mapping[str, Mapping[str, list[str]]], cpu_engine: Iterable[str]
) -> dict:
    """The snapshot: our side (`client`: "METHOD /path" -> {"body": keys, "query": names} sent;
    `cpu_engine`: the routes it serves) and SGLang's at `root` (its table, and what our routes meet)."""
    routes = sglang_routes(root)
    by_key: dict[str, list[Route]] = defaultdict(list)
    for route in routes:
        by_key[route.key].append(route)
    bodies, queries = {}, {}
    for key, sent in sorted(client.items()):
        handlers = by_key.get(key, [])
        if "body" in sent and handlers and handlers[0].body_type:  # an empty body too: {} must validate
            bodies[key] = _body(root, handlers[0].body_type)
        if sent.get("query") and handlers:
            queries[key] = sorted(handlers[0].params)
    return {
        "sglang_version": sglang_version(root),
        "client": {key: {k: sorted(v) for k, v in sent.items()} for key, sent in sorted(client.items())},
        "cpu_engine": sorted(set(cpu_engine)),
        "sglang_routes": sorted({r.key for r in routes}, key=lambda k: (k.split(" ", 1)[1], k)),
        "sglang_route_notes": {r.key: r.note for r in routes if r.note},
        "sglang_bodies": bodies,
        "sglang_handler_params": queries,
    }


def _body(root: Path, body_type: str) -> dict[str, Any]:
    try:
        fields = io_struct_fields(root, body_type)
    except KeyError:  # not an io_struct class (an OpenAI pydantic model): its fields are not read here
        return {"type": body_type, "fields": None}
    described = {
        name: {"type": spec.annotation, "required": spec.default is NO_DEFAULT}
        for name, spec in fields.items()
    }
    return {"type": body_type, "fields": described}


def table_of(keys: Iterable[str]) -> dict[str, set[str]]:
    """Keys such as "GET /health" -> path -> methods, as route_table."""
    table: dict[str, set[str]] = defaultdict(set)
    for key in keys:
        method, path = key.split(" ", 1)
        table[path].add(method)
    return dict(table)


def _route_changes(old: dict, new: dict) -> list[str]:
    before, after = table_of(old["sglang_routes"]), table_of(new["sglang_routes"])
    lines = [f"route added: {' '.join(sorted(after[p]))} {p}" for p in sorted(after.keys() - before.keys())]
    lines += [
        f"route removed: {' '.join(sorted(before[p]))} {p}" for p in sorted(before.keys() - after.keys())
    ]
    for path in sorted(before.keys() & after.keys()):
        if before[path] != after[path]:
            lines.append(
                f"methods of {path}: {' '.join(sorted(before[path]))} -> {' '.join(sorted(after[path]))}"
            )
    old_notes, new_notes = old["sglang_route_notes"], new["sglang_route_notes"]
    for key in sorted(old_notes.keys() | new_notes.keys()):
        if old_notes.get(key) != new_notes.get(key) and key in new["sglang_routes"]:
            lines.append(f"condition of {key}: {old_notes.get(key)!r} -> {new_notes.get(key)!r}")
    return lines


def _field_changes(
    key: str, old: dict | None, new: dict | None, sent: set[str]
) -> tuple[list[str], list[str]]:
    """(changes, breaks) of one body the client sends: a sent field gone or a field newly required breaks."""
    if old is None or new is None:
        return [], ([f"{key}: SGLang's handler takes no io_struct body any more"] if new is None else [])
    changes = [f"{key}: body type {old['type']} -> {new['type']}"] if old["type"] != new["type"] else []
    before, after = old["fields"] or {}, new["fields"] or {}
    changes += [f"{key}: field added {f} ({after[f]['type']})" for f in sorted(after.keys() - before.keys())]
    changes += [f"{key}: field removed {f}" for f in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        for aspect in ("type", "required"):
            if before[name][aspect] != after[name][aspect]:
                changes.append(f"{key}: {name} {aspect} {before[name][aspect]} -> {after[name][aspect]}")
    breaks = [
        f"{key}: the client sends {f}, SGLang's {new['type']} has no such field"
        for f in sorted(sent - after.keys())
    ]
    breaks += [
        f"{key}: {f} is required by SGLang, the client does not send it"
        for f, spec in sorted(after.items())
        if spec["required"] and f not in sent and f not in ("http_worker_ipc",)
    ]
    return changes, breaks


def compare(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """What changed between two contracts, and what of it breaks the client or the CPU engine."""
    changes = _route_changes(old, new)
    table = table_of(new["sglang_routes"])
    breaks = missing_routes(old["client"], table, "the client")
    breaks += missing_routes(old["cpu_engine"], table, "the CPU engine")
    for key, sent in old["client"].items():
        if key not in new["sglang_routes"]:  # reported once, above, not again for its body and query
            continue
        if key in old["sglang_bodies"]:
            more, broken = _field_changes(
                key, old["sglang_bodies"][key], new["sglang_bodies"].get(key), set(sent.get("body", []))
            )
            changes += more
            breaks += broken
        gone = set(sent.get("query", [])) - set(new["sglang_handler_params"].get(key, []))
        breaks += [
            f"{key}: the client sends ?{q}=, SGLang's handler has no such parameter" for q in sorted(gone)
        ]
    return changes, breaks


# ----- command line ------------------------------------------------------------------------------------


def our_usage() -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """What the client sends and the CPU engine serves, recorded by the tests' helper (needs the venv)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.fast.engines.sglang_usage import client_usage, cpu_engine_routes

    return client_usage(), sorted(cpu_engine_routes())


def _dumps(value: Any, indent: int = 0) -> str:
    """JSON, one line for a list or object of plain values that fits: a field or a body reads as a line."""
    flat = json.dumps(value)
    nested = isinstance(value, dict | list) and any(
        isinstance(v, dict | list) for v in (value.values() if isinstance(value, dict) else value)
    )
    if not isinstance(value, dict | list) or (not nested and indent + len(flat) <= 100):
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{_dumps(v, indent + 2)}" for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def write(path: Path, contract: dict) -> None:
    path.write_text(_dumps(contract) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-root", type=Path, help="the sglang package directory (default: installed)")
    parser.add_argument("--compare", type=Path, required=True, help="the committed snapshot (JSON)")
    parser.add_argument(
        "--write", action="store_true", help="rewrite the snapshot from this SGLang and our code"
    )
    args = parser.parse_args(argv)
    root = (args.sglang_root or installed_root()).resolve()
    if not (root / HTTP_SERVER).is_file():
        raise SystemExit(f"{root / HTTP_SERVER} not found: --sglang-root is the `sglang` package directory")
    if args.write and not args.compare.exists():  # the first snapshot: nothing to compare with
        write(args.compare, build_contract(root, *our_usage()))
        print(f"wrote {args.compare}")
        return 0
    old = json.loads(args.compare.read_text())
    new = build_contract(root, old["client"], old["cpu_engine"])
    changes, breaks = compare(old, new)
    print(f"SGLang {old['sglang_version']} (snapshot {args.compare}) -> {new['sglang_version']} ({root})")
    print(
        "\n".join(f"  {line}" for line in changes) or "  no change in SGLang's routes or our bodies' fields"
    )
    if breaks:
        print("BROKEN for the client or the CPU engine:")
        print("\n".join(f"  {line}" for line in breaks))
    else:
        print("nothing the client or the CPU engine uses is broken")
    if args.write:
        write(args.compare, build_contract(root, *our_usage()))
        print(f"wrote {args.compare}")
        return 0
    return 1 if breaks else 0


if __name__ == "__main__":
    sys.exit(main())
