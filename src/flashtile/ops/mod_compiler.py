"""User score and mask mods (FlexAttention's) made into Triton device functions (issue 74).

A mod is written in torch operations, `score_mod(score, b, h, q_idx, kv_idx) -> score` or
`mask_mod(b, h, q_idx, kv_idx) -> bool`. `compile_mods` traces it once with make_fx on one-element
tensors (which records the aten operations it performs and the tensors it captures, as constants)
and writes a `@triton.jit` function with the same arguments plus `data`: a pointer to an int64 table
(`ModTable`) that holds, per captured tensor, its address, sizes and strides. The kernels call the
function on a block of scores with q_idx and kv_idx broadcast along the block's rows and columns.

Nothing of a call is compiled in: a captured tensor's address, sizes and strides are read from the
table at run time, so new values, new lengths or a new tensor of the same dtype and rank reuse the
kernel. What is compiled in is the graph's structure: its operations, the captures' dtypes and ranks,
and Python constants (a cap of 30.0): that is the cache key, and the generated function's name holds
its hash (Triton's cache keys a constexpr function by name).

For the backward, `score_grad` is the mod's reverse-mode derivative derived from the same graph:
given dL/d(modded score), it returns dL/d(score) and adds into each captured float tensor that
requires grad its gradient (atomic adds into a float32 buffer, at the element the forward read).

Indexing a captured tensor clamps each index into its dimension (a negative one counts from the end,
as torch's): a block's padding rows and columns reach past the lengths, where the result is masked
anyway. An operation outside the table below raises ModCompileError naming it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from typing import Callable, NamedTuple, Optional

import torch

_TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
              torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
              torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


class ModCompileError(ValueError):
    """A mod uses something the compiler cannot turn into kernel code (named in the message)."""


class CompiledMods(NamedTuple):
    """The device functions of a call's mods (None where there is none) and the tensors they read.

    score(score, b, h, q_idx, kv_idx, data) -> score, mask(b, h, q_idx, kv_idx, data) -> int1 and
    score_grad(score, b, h, q_idx, kv_idx, data, grad, valid) -> dL/dscore; captures in table
    order; grads[i]: whether captures[i] gets a gradient (a float32 buffer's address follows the
    captures in the table: grad_at[i])."""

    score: Optional[Callable]
    score_grad: Optional[Callable]
    mask: Optional[Callable]
    captures: tuple
    grad_at: tuple  # per capture: its gradient buffer's entry in the table, or -1
    key: str


def _trace(fn: Callable, n_args: int):
    from torch.fx.experimental.proxy_tensor import make_fx

    # one element each and distinct objects: make_fx would merge arguments that are the same tensor,
    # and a 0-d integer tensor used as an index is read as a Python int (data-dependent)
    ints = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    args = ([torch.zeros(1, dtype=torch.float32)] if n_args == 5 else []) + ints
    try:
        return make_fx(fn)(*args)
    except Exception as e:  # data-dependent Python control flow and the like
        raise ModCompileError(f"{getattr(fn, '__name__', 'mod')}: cannot be traced into kernel code: {e}") from e


def _literal(x) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    if isinstance(x, int):
        return str(x)
    raise ModCompileError(f"a constant of type {type(x).__name__} ({x!r})")


class _View(NamedTuple):
    """A captured tensor seen through fixed indices (select): capture number, (dim -> int) and the
    dims still free, in order."""

    capture: int
    fixed: tuple  # ((dim, index), ...)
    free: tuple


# forward expressions of elementwise operations: aten name -> template over {0}, {1}, ...
_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "rsub": "({1} - {0})",
           "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
           "gt": "({0} > {1})", "ge": "({0} >= {1})", "bitwise_and": "({0} & {1})",
           "bitwise_or": "({0} | {1})", "bitwise_xor": "({0} ^ {1})", "logical_and": "(({0} != 0) & ({1} != 0))",
           "logical_or": "(({0} != 0) | ({1} != 0))", "logical_xor": "(({0} != 0) ^ ({1} != 0))",
           "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
           "floor_divide": "floor_div({0}, {1})", "remainder": "py_remainder({0}, {1})"}
_UNARY = {"neg": "(-{0})", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})",
          "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
          "sigmoid": "tl.sigmoid({0})", "tanh": "tanh({0})", "exp2": "tl.exp2({0})", "log2": "tl.log2({0})",
          "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "reciprocal": "(1.0 / {0})",
          "relu": "tl.maximum({0}, 0)", "logical_not": "({0} == 0)", "sign": "sign({0})"}
_IDENTITY = {"alias", "clone", "detach", "lift_fresh_copy", "_to_copy", "to", "view", "reshape", "expand",
             "squeeze", "unsqueeze"}


class _Writer:
    """Writes one mod's graph as Triton statements; values by node name."""

    def __init__(self, gm, captures: list, table_at: list):
        self.gm, self.captures, self.table_at = gm, captures, table_at
        self.lines: list = []
        self.value: dict = {}  # node -> expression (a local's name or a literal)
        self.views: dict = {}  # node -> _View of a captured tensor
        self.loads: dict = {}  # index node -> (capture number, offset expression)
        self.float_nodes: set = set()

    def positional(self, node) -> bool:
        """Does node's value depend on q_idx or kv_idx (differ across a block)?"""
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and self.value.get(n) in ("q_idx", "kv_idx"):
                return True
            todo.extend(a for a in _flat(n.args) if isinstance(a, torch.fx.Node))
        return False

    def emit(self, name: str, expr: str) -> str:
        self.lines.append(f"    {name} = {expr}")
        return name

    def arg(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            if a in self.views:
                raise ModCompileError(f"a captured tensor used whole ({a.name}); index every dimension")
            return self.value[a]
        return _literal(a)

    def capture_of(self, node) -> int:
        """The number of the captured tensor node reads (compile_mods laid every capture out first)."""
        tensor = getattr(self.gm, node.target)
        return next(i for i, t in enumerate(self.captures) if t is tensor)

    def table(self, capture: int, slot: int) -> str:
        return f"tl.load(data + {self.table_at[capture] + slot})"

    def write(self, node) -> None:
        op, name = node.op, "v_" + node.name  # never a helper's name (tanh, sign)
        if op == "placeholder":
            return
        if op == "get_attr":
            c = self.capture_of(node)
            t = self.captures[c]
            if t.dim() == 0:
                raise ModCompileError("a captured 0-d tensor: capture a Python number or a 1-element tensor")
            self.views[node] = _View(c, (), tuple(range(t.dim())))
            return
        if op == "output":
            return
        if op != "call_function":
            raise ModCompileError(f"graph node {op} {node.target}")
        target = node.target
        packet = getattr(target, "_overloadpacket", None)
        aten = getattr(packet, "__name__", str(target))
        args, kwargs = node.args, node.kwargs
        meta = node.meta.get("val")
        dtype = getattr(meta, "dtype", None)
        if dtype is not None and dtype.is_floating_point:
            self.float_nodes.add(node)
        if aten == "select" and args[0] in self.views:
            view = self.views[args[0]]
            dim = view.free[args[1]]
            self.views[node] = _View(view.capture, view.fixed + ((dim, args[2]),),
                                     tuple(d for d in view.free if d != dim))
            return
        if aten == "index" and args[0] in self.views:
            view, idx = self.views[args[0]], args[1]
            if len(idx) != len(view.free) or any(i is None for i in idx):
                raise ModCompileError(f"{name}: index a captured tensor with one index per dimension")
            c = view.capture
            t = self.captures[c]
            nd = t.dim()
            parts = []
            for dim, i in view.fixed:
                parts.append(f"{_literal(i % t.shape[dim] if i < 0 else i)} * {self.table(c, 1 + nd + dim)}")
            for dim, i in zip(view.free, idx):
                size = self.table(c, 1 + dim)
                raw = self.emit(f"{name}_i{dim}", f"({self.arg(i)}).to(tl.int64)")
                clamped = self.emit(f"{name}_c{dim}", f"tl.minimum(tl.maximum(tl.where({raw} < 0, {raw} + {size}, "
                                                      f"{raw}), 0), {size} - 1)")
                parts.append(f"{clamped} * {self.table(c, 1 + nd + dim)}")
            offset = self.emit(f"{name}_off", " + ".join(parts))
            element = "tl.int8" if t.dtype == torch.bool else _TL_DTYPES[t.dtype]  # a bool is a byte
            loaded = f"tl.load(tl.load(data + {self.table_at[c]}).to(tl.pointer_type({element})) + {offset})"
            self.value[node] = self.emit(name, f"{loaded} != 0" if t.dtype == torch.bool else loaded)
            self.loads[node] = (c, offset)
            return
        if aten in ("scalar_tensor", "full"):
            value = args[0] if aten == "scalar_tensor" else args[1]
            self.value[node] = self.emit(name, f"tl.full((), {_literal(value)}, {_TL_DTYPES[dtype]})")
            return
        if aten in _IDENTITY:
            src = self.arg(args[0])
            if dtype is not None and getattr(args[0].meta.get("val"), "dtype", dtype) != dtype:
                src = f"({src} != 0)" if dtype == torch.bool else f"({src}).to({_TL_DTYPES[dtype]})"
            self.value[node] = self.emit(name, src)
            return
        if aten == "where":
            c, a, b = (self.arg(x) for x in args)
            self.value[node] = self.emit(name, f"tl.where({c}, {a}, {b})")
            return
        if aten in ("clamp", "clamp_min", "clamp_max"):
            x = self.arg(args[0])
            lo = args[1] if aten != "clamp_max" else None
            hi = (args[2] if len(args) > 2 else kwargs.get("max")) if aten == "clamp" else (
                args[1] if aten == "clamp_max" else None)
            if lo is not None:
                x = f"tl.maximum({x}, {self.arg(lo)})"
            if hi is not None:
                x = f"tl.minimum({x}, {self.arg(hi)})"
            self.value[node] = self.emit(name, x)
            return
        if aten == "pow":
            base, exponent = args
            if isinstance(exponent, torch.fx.Node) or not isinstance(exponent, (int, float)):
                raise ModCompileError(f"{name}: pow with a tensor exponent")
            x = self.arg(base)
            if exponent == 2:
                expr = f"({x} * {x})"
            elif exponent == 0.5:
                expr = f"tl.sqrt({x})"
            elif float(exponent).is_integer() and 0 <= exponent <= 4:
                expr = "(" + " * ".join([x] * int(exponent)) + ")" if exponent else "1.0"
            else:
                expr = f"tl.exp2({_literal(float(exponent))} * tl.log2({x}))"
            self.value[node] = self.emit(name, expr)
            return
        if aten == "div":
            a, b = (self.arg(x) for x in args[:2])
            mode = kwargs.get("rounding_mode")
            if mode == "floor":
                expr = f"floor_div({a}, {b})" if not dtype.is_floating_point else f"tl.floor({a} / {b})"
            elif mode == "trunc":
                expr = f"({a} // {b})" if not dtype.is_floating_point else f"trunc({a} / {b})"
            else:
                expr = f"(({a}).to(tl.float32) / {b})"
            self.value[node] = self.emit(name, expr)
            return
        if aten in _BINARY:
            if kwargs.get("alpha", 1) != 1:
                raise ModCompileError(f"{name}: {aten} with alpha")
            a, b = (self.arg(x) for x in args[:2])
            self.value[node] = self.emit(name, _BINARY[aten].format(a, b))
            return
        if aten in _UNARY:
            self.value[node] = self.emit(name, _UNARY[aten].format(self.arg(args[0])))
            return
        if aten == "bitwise_not":
            x = self.arg(args[0])
            self.value[node] = self.emit(name, f"({x} == 0)" if dtype == torch.bool else f"(~{x})")
            return
        if aten in ("zeros_like", "ones_like", "full_like"):
            value = {"zeros_like": 0, "ones_like": 1}.get(aten, args[1] if len(args) > 1 else None)
            self.value[node] = self.emit(name, f"tl.full({self.arg(args[0])}.shape, {_literal(value)}, "
                                               f"{_TL_DTYPES[dtype]})")
            return
        if any(isinstance(a, torch.fx.Node) and a in self.views for a in _flat(args)):
            raise ModCompileError(f"a captured tensor used whole by {target}: index every dimension")
        raise ModCompileError(f"the operation {target} ({node.format_node()}) has no kernel code; "
                              "supported: elementwise arithmetic, comparisons, where, clamp, pow, "
                              "exp/log/tanh/sigmoid/..., and indexing captured tensors")


# reverse-mode rules: aten name -> [(argument position, adjoint expression)] over {g} (the node's
# adjoint), {y} (its value) and {a0}, {a1}, ... (its arguments)
_ADJOINTS = {
    "add": [(0, "{g}"), (1, "{g}")],
    "sub": [(0, "{g}"), (1, "-{g}")],
    "rsub": [(0, "-{g}"), (1, "{g}")],
    "mul": [(0, "{g} * {a1}"), (1, "{g} * {a0}")],
    "div": [(0, "{g} / {a1}"), (1, "-{g} * {a0} / ({a1} * {a1})")],
    "neg": [(0, "-{g}")],
    "exp": [(0, "{g} * {y}")],
    "exp2": [(0, "{g} * {y} * 0.6931471805599453")],
    "log": [(0, "{g} / {a0}")],
    "log2": [(0, "{g} / ({a0} * 0.6931471805599453)")],
    "tanh": [(0, "{g} * (1.0 - {y} * {y})")],
    "sigmoid": [(0, "{g} * {y} * (1.0 - {y})")],
    "sqrt": [(0, "{g} * 0.5 / {y}")],
    "rsqrt": [(0, "{g} * -0.5 * {y} * {y} * {y}")],
    "sin": [(0, "{g} * tl.cos({a0})")],
    "cos": [(0, "-{g} * tl.sin({a0})")],
    "reciprocal": [(0, "-{g} * {y} * {y}")],
    "abs": [(0, "{g} * sign({a0})")],
    "relu": [(0, "tl.where({a0} > 0, {g}, 0.0)")],
    "where": [(1, "tl.where({a0}, {g}, 0.0)"), (2, "tl.where({a0}, 0.0, {g})")],
    "maximum": [(0, "tl.where({a0} > {a1}, {g}, tl.where({a0} == {a1}, 0.5 * {g}, 0.0))"),
                (1, "tl.where({a1} > {a0}, {g}, tl.where({a0} == {a1}, 0.5 * {g}, 0.0))")],
    "minimum": [(0, "tl.where({a0} < {a1}, {g}, tl.where({a0} == {a1}, 0.5 * {g}, 0.0))"),
                (1, "tl.where({a1} < {a0}, {g}, tl.where({a0} == {a1}, 0.5 * {g}, 0.0))")],
    "floor": [], "ceil": [], "sign": [], "zeros_like": [], "ones_like": [], "full_like": [],
}
_PASS_THROUGH = _IDENTITY | {"clamp", "clamp_min", "clamp_max", "pow"}


def _adjoint_lines(w: _Writer, out_node, score_node, grad_at: dict) -> list:
    """Statements computing dL/dscore (returned as `d_score`) from `grad` by reverse mode over w's
    graph, with atomic adds into the gradient buffers of the captures in grad_at."""
    nodes = list(w.gm.graph.nodes)
    # nodes whose value depends on the score or on a load from a capture that gets a gradient
    live = {score_node}
    for n in nodes:
        if n in w.loads and w.loads[n][0] in grad_at:
            live.add(n)
        elif n.op == "call_function" and any(isinstance(a, torch.fx.Node) and a in live for a in _flat(n.args)):
            if n in w.float_nodes:
                live.add(n)
    adj: dict = {out_node: "grad"} if out_node in live else {}
    lines = []

    def add_to(node, expr):
        if node not in live:
            return
        name = f"g_{node.name}"
        if node in adj:
            lines.append(f"    {name} = {adj[node]} + ({expr})")
        else:
            lines.append(f"    {name} = {expr}")
        adj[node] = name

    for n in reversed(nodes):
        if n not in adj or n.op != "call_function":
            continue
        g = adj[n]
        packet = getattr(n.target, "_overloadpacket", None)
        aten = getattr(packet, "__name__", str(n.target))
        if n in w.loads:
            c, offset = w.loads[n]
            if c in grad_at:
                ptr = f"tl.load(data + {grad_at[c]}).to(tl.pointer_type(tl.float32))"
                if w.positional(n):  # an element per score: one atomic add each (torch's kernels too)
                    lines.append(f"    tl.atomic_add({ptr} + ({offset} + tl.zeros_like({g}).to(tl.int64)), "
                                 f"tl.where(valid, {g}, 0.0))")
                else:  # the same element for the whole block (a per-head slope): one add of the block's sum
                    lines.append(f"    tl.atomic_add({ptr} + {offset}, tl.sum(tl.sum(tl.where(valid, {g}, 0.0), 1), 0))")
            continue
        subs = {"g": g, "y": w.value[n]}
        for i, a in enumerate(n.args):
            if isinstance(a, (torch.fx.Node, int, float)) and not isinstance(a, bool):
                subs[f"a{i}"] = w.arg(a) if not (isinstance(a, torch.fx.Node) and a in w.views) else "0"
        if aten in _PASS_THROUGH:
            x = n.args[0]
            if aten == "pow":
                e = n.args[1]
                add_to(x, f"{g} * {_literal(float(e))} * " + (
                    f"{w.arg(x)}" if e == 2 else f"tl.exp2({_literal(float(e) - 1)} * tl.log2({w.arg(x)}))"))
            elif aten.startswith("clamp"):
                add_to(x, f"tl.where({w.value[n]} == {w.arg(x)}, {g}, 0.0)")
            else:
                add_to(x, g)
            continue
        if aten not in _ADJOINTS:
            raise ModCompileError(f"the derivative of {n.target} ({n.format_node()}) is not known")
        for i, template in _ADJOINTS[aten]:
            a = n.args[i] if i < len(n.args) else None
            if isinstance(a, torch.fx.Node):
                expr = template.format(**{k: f"({v})" for k, v in subs.items()})
                add_to(a, expr)
    lines.append(f"    d_score = {adj.get(score_node, '0.0 * grad')}")
    return lines


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


_PRELUDE = '''import triton
import triton.language as tl

from flashtile.ops.mods import floor_div, py_remainder, sign, tanh, trunc

'''

_loaded: dict = {}  # key -> module


def _module(source: str, key: str):
    """The generated source as an imported module (Triton reads a kernel's source from its file)."""
    mod = _loaded.get(key)
    if mod is not None:
        return mod
    folder = os.path.join(tempfile.gettempdir(), f"flashtile_mods_{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"mods_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"flashtile_mods_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    _loaded[key] = mod
    return mod


def _structure(gm, captures: list) -> str:
    code = gm.code
    return code + "|" + ",".join(f"{t.dtype}:{t.dim()}" for t in captures)


_compiled: dict = {}  # (graph structure) -> module functions
with open(__file__, "rb") as _f:  # the generated files on disk are this compiler's: a new one writes new files
    _VERSION = hashlib.sha256(_f.read()).hexdigest()[:8]


def compile_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], table_start: int,
                 need_grad: bool) -> CompiledMods:
    """The device functions of score_mod and mask_mod (either may be None) whose captures' entries
    start at table_start in the table; need_grad: derive score_grad too (captures that require grad
    get gradient buffers)."""
    graphs = [None if fn is None else _trace(fn, n_args) for fn, n_args in ((score_mod, 5), (mask_mod, 4))]
    # the table: per capture (score mod's first, in graph order), its address, sizes and strides
    captures: list = []
    for gm in filter(None, graphs):
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                tensor = getattr(gm, n.target)
                if not any(t is tensor for t in captures):
                    captures.append(tensor)
    table_at: list = []
    at = table_start
    for t in captures:
        table_at.append(at)
        at += 1 + 2 * t.dim()
    grad_at = {}
    if need_grad and graphs[0] is not None:
        for i, t in enumerate(captures):
            if t.requires_grad and t.dtype.is_floating_point:
                grad_at[i] = at
                at += 1
    structure = "||".join(_structure(gm, captures) if gm is not None else "-" for gm in graphs)
    structure += f"|start={table_start}|grads={sorted(grad_at)}|{_VERSION}"
    key = hashlib.sha256(structure.encode()).hexdigest()[:16]
    fns = _compiled.get(key)
    if fns is None:
        parts = [_PRELUDE]
        names = {}
        for gm, kind in zip(graphs, ("score", "mask")):
            if gm is None:
                continue
            w = _Writer(gm, captures, table_at)
            nodes = list(gm.graph.nodes)
            placeholders = [n for n in nodes if n.op == "placeholder"]
            params = (["score"] if kind == "score" else []) + ["b", "h", "q_idx", "kv_idx"]
            for n, p in zip(placeholders, params):
                w.value[n] = p
            for n in nodes:
                w.write(n)
            out = nodes[-1].args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            result = w.arg(out)
            fn_name = f"{kind}_mod_{key}"
            if kind == "score":
                body = w.lines + [f"    return ({result}).to(tl.float32)"]
            else:
                body = w.lines + [f"    return ({result}) != 0"]
            parts.append(f"@triton.jit\ndef {fn_name}({', '.join(params)}, data):\n" + "\n".join(body or ["    pass"])
                         + "\n\n")
            names[kind] = fn_name
            if kind == "score" and need_grad:
                adjoint = _adjoint_lines(w, out, placeholders[0], grad_at)
                gname = f"score_grad_{key}"
                parts.append(f"@triton.jit\ndef {gname}({', '.join(params)}, data, grad, valid):\n"
                             + "\n".join(w.lines + adjoint + ["    return d_score"]) + "\n\n")
                names["score_grad"] = gname
        mod = _module("".join(parts), key)
        fns = _compiled[key] = {k: getattr(mod, v) for k, v in names.items()}
    grad_list = tuple(grad_at.get(i, -1) for i in range(len(captures)))
    return CompiledMods(fns.get("score"), fns.get("score_grad"), fns.get("mask"), tuple(captures), grad_list, key)


def table_entries(mods: CompiledMods, grads: dict) -> list:
    """The table's entries for mods' captures (addresses, sizes, strides) and their gradient buffers
    (grads: capture number -> float32 buffer with the capture's shape and strides: grad_buffer)."""
    out = []
    for t in mods.captures:
        out += [t.data_ptr(), *t.shape, *t.stride()]
    for i, g in enumerate(mods.grad_at):
        if g >= 0:
            out.append(grads[i].data_ptr())
    return out


def grad_buffer(t: torch.Tensor) -> torch.Tensor:
    """A zeroed float32 buffer laid out as t (its strides: the generated code adds at the offset it read
    t at; an expanded t's stride-0 dimensions sum there, as autograd sums an expand)."""
    return torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.float32,
                       device=t.device).as_strided(t.shape, t.stride(), t.storage_offset())
