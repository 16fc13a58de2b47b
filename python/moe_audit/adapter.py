"""Serve a Python MoE router to moe-audit over its protocol (docs/PROTOCOL.md).

Write a function ``route(data, mode)`` and hand it to :func:`run`::

    from moe_audit import routes_from_arrays, run

    def route(data, mode):
        # data: float32 array [batch, seq_len, width] (width = experts for input="logits",
        # hidden_size for input="hidden"); mode: "train" or "inference".
        ...
        return routes_from_arrays(experts, weights, kept), capacity

    run(route, name="my-router", experts=8, top_k=2, input="logits")

``route`` returns, for each of the batch*seq_len tokens in sequence-major order (token
``b * seq_len + s``), its routes in choice order: :func:`routes_from_arrays` builds them from
``[T, k]`` arrays, and a list of ``(expert, weight, kept)`` tuples (or dicts with those keys) per
token works too. ``weight`` is the combine weight, or for a dropped route the gate it had before
dropping. ``capacity`` is None (dropless), an int (the same slot count for every expert), one slot
count per expert (E ints) for the whole call, or ``{"scope": "sequence" | "batch" | "tokens:N",
"slots": [...]}`` (one count per group; needs ``moe-audit/2``). Returning the routes alone means
``capacity = None``. A ``route`` that takes ``seed`` or ``padding`` keywords gets them
(``moe-audit/2``: the audit's seed, and the padding mask ``[batch, seq_len]`` bool or None).

Each answer is checked before it is sent: a wrong number of tokens, an expert id out of range or
twice in one token, a weight that is not finite, a kept flag that is not a bool, a capacity of
another form raise TypeError or ValueError with a one-line message naming the token (t, and its
batch b and position s) and the field; the router exits with the traceback on stderr, whose last
line moe-audit quotes.

``python3 my_router.py`` serves the router on stdin/stdout (``moe-audit check --router-cmd``);
``python3 my_router.py --answer-plan DIR`` answers a trace plan (``moe-audit plan``) instead,
writing ``DIR/decisions.jsonl``. Only numpy is needed.

stdout carries the protocol only, starting with the handshake line. Once :func:`run` is called,
``print`` goes to stderr (from any thread). Before that, at import time or while loading a model,
print to stderr yourself (``print("loading my model...", file=sys.stderr)``): text printed to
stdout before ``run()`` would come ahead of the handshake, and moe-audit stops at a first line that
is not the handshake.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import struct
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, Callable, Union

import numpy as np
import numpy.typing as npt

from ._wire import v1, v2
from ._wire.v1 import Columns

#: The protocols' names, for ``protocol=`` (``1`` and ``2`` work too).
PROTOCOL_V1: str = v1.PROTOCOL
PROTOCOL_V2: str = v2.PROTOCOL
PROTOCOLS = {v1.PROTOCOL: v1, v2.PROTOCOL: v2}

#: A protocol as a router may name it: 1, 2, "moe-audit/1" or "moe-audit/2".
Protocol = Union[int, str]
#: One route: (expert, weight, kept), or a dict with those keys.
Route = Union[tuple[int, float, bool], dict[str, Any]]
#: A route function's tokens: :class:`Routes`, or a list of routes per token.
Tokens = Union["Routes", Sequence[Sequence[Route]]]
#: A capacity: None (dropless), an int (the same slots for every expert), one slot count per
#: expert, or ``{"scope": ..., "slots": [...]}``.
Capacity = Union[None, int, Sequence[int], dict[str, Any]]
#: ``route(data, mode)`` (optionally with ``seed`` and ``padding`` keywords): tokens, or
#: (tokens, capacity).
RouteFn = Callable[..., Union[Tokens, tuple[Tokens, Capacity]]]


class RouterObject(typing.Protocol):
    """A router given as an object: its ``route`` method, and the attributes ``name``,
    ``experts``, ``top_k``, ... where it has them (:func:`describe` reads them)."""

    @property
    def route(self) -> RouteFn: ...


#: A router: a route function, or an object with a ``route`` method.
Router = Union[RouteFn, RouterObject]


def protocol_name(protocol: Protocol) -> str:
    """The protocol's name: 1, 2, "moe-audit/1" or "moe-audit/2" (what a router may pass)."""
    names: dict[Protocol, Protocol] = {1: v1.PROTOCOL, 2: v2.PROTOCOL}
    name = names.get(protocol, protocol)
    if not isinstance(name, str) or name not in PROTOCOLS:
        raise ValueError(f"protocol must be 1 or 2 ({', '.join(PROTOCOLS)}), got {protocol!r}")
    return name


_BUILD = "moe-audit adapter: routes_from_arrays():"


def _ids(experts: np.ndarray) -> np.ndarray:
    """Expert ids as int64: integers, or floats with whole values (an array made with np.zeros)."""
    if experts.dtype.kind == "f":
        whole = np.isfinite(experts) & (experts == np.floor(experts))
        if not whole.all():
            at = tuple(int(i) for i in np.argwhere(~whole)[0])
            raise ValueError(f"{_BUILD} experts{list(at)} is {experts[at]}, not an expert id (an integer)")
    elif experts.dtype.kind not in "iu":
        raise TypeError(f"{_BUILD} experts must be integer expert ids, got a {experts.dtype} array")
    return experts.astype(np.int64)


def _flags(name: str, a: np.ndarray) -> np.ndarray:
    """Flags as bool: bools, or numbers that are 0 or 1 (anything else would be truthy by accident)."""
    if a.dtype.kind in "iuf":
        bad = (a != 0) & (a != 1)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{_BUILD} {name}{list(at)} is {a[at]}, not a bool (True/False or 1/0)")
    elif a.dtype.kind != "b":
        raise TypeError(f"{_BUILD} {name} must be bools, got a {a.dtype} array")
    return a.astype(bool)


class Routes:
    """Every token's routes as ``[T, k]`` arrays: expert ids, weights, kept flags, and which
    routes exist (all, unless some tokens have fewer, such as padding left unrouted).

    A sequence of tokens, each a list of ``(expert, weight, kept)`` tuples, for code that reads
    routes one token at a time; the protocol encoders take the arrays as they are.
    """

    def __init__(self, experts: npt.ArrayLike, weights: npt.ArrayLike, kept: npt.ArrayLike | None = None,
                 present: npt.ArrayLike | None = None) -> None:
        self.experts = _ids(np.asarray(experts))
        weights = np.asarray(weights)
        if weights.dtype.kind not in "iuf":
            raise TypeError(f"{_BUILD} weights must be numbers, got a {weights.dtype} array")
        self.weights = weights.astype(np.float64)
        self.kept = np.ones(self.experts.shape, dtype=bool) if kept is None else _flags("kept", np.asarray(kept))
        if not (self.experts.ndim == 2 and self.experts.shape == self.weights.shape == self.kept.shape):
            raise ValueError(
                f"{_BUILD} experts, weights and kept must be [tokens, k] arrays of one shape, got "
                f"{self.experts.shape}, {self.weights.shape}, {self.kept.shape}"
            )
        self.present: np.ndarray | None = None
        if present is not None:
            flags = _flags("present", np.asarray(present))
            try:
                self.present = np.broadcast_to(flags, self.experts.shape)
            except ValueError:
                raise ValueError(f"{_BUILD} present has shape {flags.shape}, which does not broadcast to the "
                                 f"routes' {self.experts.shape}") from None

    def __len__(self) -> int:
        return len(self.experts)

    def __getitem__(self, t: int) -> list[tuple[int, float, bool]]:
        routes = zip(self.experts[t], self.weights[t], self.kept[t])
        present = np.ones(self.experts.shape[1], dtype=bool) if self.present is None else self.present[t]
        return [(int(e), float(w), bool(k)) for (e, w, k), p in zip(routes, present) if p]

    def columns(self) -> Columns:
        """(count [T], expert [R], weight [R], kept [R]): the routes flattened in token order."""
        t, k = self.experts.shape
        if self.present is None:
            return np.full(t, k), self.experts.reshape(-1), self.weights.reshape(-1), self.kept.reshape(-1)
        p = self.present
        return p.sum(axis=1), self.experts[p], self.weights[p], self.kept[p]


def routes_from_arrays(experts: npt.ArrayLike, weights: npt.ArrayLike, kept: npt.ArrayLike | None = None,
                       present: npt.ArrayLike | None = None) -> Routes:
    """The routes of arrays [T, k]: expert ids, weights, kept flags (all kept when None), and
    which routes exist (all when None; a token whose routes are all absent has none, as a
    padding token a router leaves out)."""
    return Routes(experts, weights, kept, present)


def columns(tokens: Tokens) -> Columns:
    """(count, expert, weight, kept) of a route function's tokens: Routes or lists of routes."""
    if isinstance(tokens, Routes):
        return tokens.columns()
    count, expert, weight, kept = [], [], [], []
    for token in tokens:
        count.append(len(token))
        for r in token:
            e, w, k = (r["expert"], r["weight"], r["kept"]) if isinstance(r, dict) else r
            expert.append(int(e))
            weight.append(float(w))
            kept.append(bool(k))
    return (np.asarray(count, dtype=np.int64), np.asarray(expert, dtype=np.int64),
            np.asarray(weight, dtype=np.float64), np.asarray(kept, dtype=bool))


_RETURNED = "moe-audit adapter: route() returned"


def _split(result: Any) -> tuple[Tokens, Capacity]:
    """(tokens, capacity) of what a route function returned."""
    if not isinstance(result, tuple):
        return result, None
    if len(result) != 2:
        raise TypeError(f"{_RETURNED} a tuple of {len(result)} items; expected the routes, or (routes, capacity)")
    return result


def _token(t: int, seq_len: int) -> str:
    """Token t named with its place: tokens are sequence-major, t = b * seq_len + s."""
    return f"token {t} (batch {t // seq_len}, position {t % seq_len})"


def _route_error(t: int, j: int, seq_len: int, problem: str, kind: type[Exception] = ValueError) -> Exception:
    return kind(f"{_RETURNED} {_token(t, seq_len)}, route {j}: {problem}")


def _out_of_range(e: int, experts: int) -> str:
    return f"expert {e} is out of range 0 to {experts - 1}"


def _token_count(n: int, batch: int, seq_len: int) -> None:
    if n != batch * seq_len:
        raise ValueError(f"{_RETURNED} {n} tokens, expected batch * seq_len = {batch} * {seq_len} = "
                         f"{batch * seq_len} (sequence-major: token b * seq_len + s)")


def _checked_arrays(routes: Routes, batch: int, seq_len: int, experts: int) -> Columns:
    """Columns of a Routes, checked with whole-array operations (a call holds ~32k tokens)."""
    e, w, k, p = routes.experts, routes.weights, routes.kept, routes.present
    shapes = [e.shape, w.shape, k.shape] + ([] if p is None else [p.shape])
    if e.ndim != 2 or len(set(shapes)) != 1:
        named = ", ".join(f"{n} {sh}" for n, sh in zip(("experts", "weights", "kept", "present"), shapes))
        raise ValueError(f"{_RETURNED} Routes whose arrays differ in shape ({named}); each must be [tokens, k]")
    _token_count(len(e), batch, seq_len)
    if e.dtype.kind not in "iu" or k.dtype != bool or w.dtype.kind != "f":
        raise TypeError(f"{_RETURNED} Routes holding experts {e.dtype}, weights {w.dtype}, kept {k.dtype}; "
                        "expected integers, floats and bools (build them with routes_from_arrays)")
    cols = routes.columns()
    count, expert, weight, _ = cols
    # Whole-array tests on the routes as sent (absent ones left out); the first bad route is
    # looked for only when one exists.
    problem = ""
    if expert.size and (expert.min() < 0 or expert.max() >= experts):
        r = int(np.argmax((expert < 0) | (expert >= experts)))
        problem = _out_of_range(int(expert[r]), experts)
    elif not np.isfinite(weight).all():
        r = int(np.argmax(~np.isfinite(weight)))
        problem = f"weight {weight[r]} is not a finite number"
    if problem:
        t = int(np.searchsorted(np.cumsum(count), r, side="right"))
        j = r - int(count[:t].sum())
        j = j if p is None else int(np.flatnonzero(p[t])[j])  # the route's column in the arrays
        raise _route_error(t, j, seq_len, problem)
    if e.shape[1] > 1:
        # Absent routes get distinct negative ids, so only present ones can repeat.
        ids = e if p is None else np.where(p, e, -1 - np.arange(e.shape[1]))
        ordered = np.sort(ids, axis=1)
        twice = ordered[:, 1:] == ordered[:, :-1]
        if twice.any():
            t, i = (int(x) for x in np.argwhere(twice)[0])
            first, second = (int(x) for x in np.flatnonzero(ids[t] == ordered[t, i])[:2])
            raise _route_error(t, second, seq_len, f"expert {ordered[t, i]} appears twice (routes {first} and "
                               f"{second}); a token routes to an expert at most once")
    return cols


def _is_flag(x: object) -> bool:
    try:
        return bool(x in (False, True))
    except (TypeError, ValueError):  # an array, or a type that refuses ==
        return False


def _checked_lists(tokens: Sequence[Any], batch: int, seq_len: int, experts: int) -> Columns:
    """Columns of routes given as one list of (expert, weight, kept) per token, checked."""
    _token_count(len(tokens), batch, seq_len)
    count, expert, weight, kept = [], [], [], []
    for t, token in enumerate(tokens):
        if not isinstance(token, Sequence) or isinstance(token, (str, bytes)):
            raise TypeError(f"{_RETURNED} {_token(t, seq_len)} as {v1.brief(token)}; a token is a list of "
                            "(expert, weight, kept) routes")
        seen: dict[int, int] = {}
        for j, r in enumerate(token):
            if isinstance(r, dict) and {"expert", "weight", "kept"} <= r.keys():
                e, w, k = r["expert"], r["weight"], r["kept"]
            elif isinstance(r, Sequence) and not isinstance(r, (str, bytes)) and len(r) == 3:
                e, w, k = r
            else:
                raise _route_error(t, j, seq_len, f"{v1.brief(r)} is not (expert, weight, kept) or a dict with "
                                   "those keys", TypeError)
            e_id = v1.count(e)
            if e_id is None and isinstance(e, (float, np.floating)) and float(e).is_integer():
                e_id = int(e)
            if e_id is None:
                raise _route_error(t, j, seq_len, f"expert {v1.brief(e)} is not an integer", TypeError)
            if not 0 <= e_id < experts:
                raise _route_error(t, j, seq_len, _out_of_range(e_id, experts))
            if e_id in seen:
                raise _route_error(t, j, seq_len, f"expert {e_id} appears twice (routes {seen[e_id]} and {j}); "
                                   "a token routes to an expert at most once")
            seen[e_id] = j
            try:
                w_value = None if isinstance(w, (str, bytes, bool, np.bool_)) else float(w)
            except (TypeError, ValueError):
                w_value = None
            if w_value is None or not np.isfinite(w_value):
                raise _route_error(t, j, seq_len, f"weight {v1.brief(w)} is not a finite number")
            if not _is_flag(k):
                raise _route_error(t, j, seq_len, f"kept {v1.brief(k)} is not a bool (True/False or 1/0)", TypeError)
            expert.append(e_id)
            weight.append(w_value)
            kept.append(bool(k))
        count.append(len(token))
    return (np.asarray(count, dtype=np.int64), np.asarray(expert, dtype=np.int64),
            np.asarray(weight, dtype=np.float64), np.asarray(kept, dtype=bool))


def checked(result: Any, batch: int, seq_len: int, experts: int) -> tuple[Columns, Capacity]:
    """(columns, capacity) of what route returned for a call of [batch, seq_len] tokens, checked
    before anything is encoded: a mistake raises TypeError or ValueError with a one-line message
    naming the token, (batch, position) and field (moe-audit quotes the last line of stderr)."""
    tokens, capacity = _split(result)
    if isinstance(tokens, Routes):
        cols = _checked_arrays(tokens, batch, seq_len, experts)
    elif isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes)):
        cols = _checked_lists(tokens, batch, seq_len, experts)
    else:
        raise TypeError(f"{_RETURNED} routes of type {type(tokens).__name__}; expected routes_from_arrays(experts, "
                        "weights, kept) or one list of (expert, weight, kept) routes per token")
    n = batch * seq_len
    form = v1.capacity_form(capacity, experts)
    if isinstance(form, dict):
        scope = form["scope"]
        groups = 1 if scope == "batch" else batch if scope == "sequence" else -(-n // int(scope[len("tokens:"):]))
        if len(form["slots"]) != groups:
            raise ValueError(f"{_RETURNED} capacity {v1.brief(capacity)}: scope {scope!r} makes {groups} group(s) "
                             f"of batch {batch} * seq_len {seq_len}, so slots needs {groups} counts, not "
                             f"{len(form['slots'])}")
    return cols, form


def _caller(route: RouteFn) -> Callable[[np.ndarray, str, int | None, np.ndarray | None], Any]:
    """route as f(data, mode, seed, padding): the keywords it does not take are dropped."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(route).parameters
    except (TypeError, ValueError):
        params = {}
    takes = {k for k in ("seed", "padding") if k in params}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        takes = {"seed", "padding"}
    return lambda data, mode, seed, padding: route(
        data, mode, **{k: v for k, v in (("seed", seed), ("padding", padding)) if k in takes}
    )


def describe(router: Router, options: dict[str, Any]) -> tuple[RouteFn, dict[str, Any]]:
    """(route, spec) of a router given as a function or an object with a ``route`` method: spec
    holds name, experts, top_k, input, hidden_size, protocol and padding_mask, each taken (and
    removed) from the options dict, else the router's attribute of that name, else its default;
    and seed_calls, the router's attribute only: an adapter object that applies the request's seed
    itself when asked (``moe_audit.hf``: ``seed_calls=True``) has it, a route function does not."""
    route = getattr(router, "route", router)
    if not callable(route):
        raise TypeError("router must be route(data, mode) or have a route(data, mode) method")
    defaults = {"name": "router", "experts": None, "top_k": None, "input": "logits", "hidden_size": None,
                "protocol": v2.PROTOCOL, "padding_mask": False}
    spec: dict[str, Any] = {}
    for key, default in defaults.items():
        value = options.pop(key, getattr(router, key, None))
        spec[key] = default if value is None else value
    if spec["experts"] is None:
        raise TypeError("experts is required (a keyword, or an attribute of the router)")
    seed_calls = getattr(router, "seed_calls", None)
    spec["seed_calls"] = seed_calls if isinstance(seed_calls, bool) else None
    return route, spec


def handshake(name: str, experts: int, top_k: int | None, input: str, hidden_size: int | None,
              protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False,
              seed_calls: bool | None = None) -> dict[str, Any]:
    """The handshake object of a router (checked here, so a mistake fails before moe-audit runs).
    ``seed_calls``: None for a route function (it gets the request's ``seed`` and applies it
    itself, or not); a bool for an adapter that offers ``seed_calls=True`` (whether it is on), so
    that moe-audit's advice for a random router names that option (``moe-audit/2`` only)."""
    protocol = protocol_name(protocol)
    if input not in ("logits", "hidden"):
        raise ValueError("input must be 'logits' or 'hidden'")
    if input == "hidden" and not hidden_size:
        raise ValueError("input='hidden' needs hidden_size")
    hs: dict[str, Any] = {"protocol": protocol, "name": name, "experts": int(experts),
          "top_k": None if top_k is None else int(top_k), "input": input}
    if hidden_size is not None:
        hs["hidden_size"] = int(hidden_size)
    if seed_calls is not None and protocol == v2.PROTOCOL:
        hs["seed_calls"] = bool(seed_calls)
    out: dict[str, Any] = PROTOCOLS[protocol].handshake(hs, padding_mask)
    return out


def serve(route: RouteFn, name: str, experts: int, top_k: int | None, input: str = "logits",
          hidden_size: int | None = None, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None,
          protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False, seed_calls: bool | None = None) -> None:
    """Speaks the protocol on binary streams (default stdin/stdout) until the input closes."""
    hs = handshake(name, experts, top_k, input, hidden_size, protocol, padding_mask, seed_calls)
    wire = PROTOCOLS[hs["protocol"]]
    width = hs["experts"] if input == "logits" else hs["hidden_size"]
    from .distributed import protocol_stdout

    inp = stdin or sys.stdin.buffer
    out = stdout or protocol_stdout()
    call = _caller(route)
    quiet: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if stdout is None:
        # Text printed before run() goes out now, ahead of the handshake (where moe-audit reports
        # it), not later in the middle of a response. From here on print() goes to stderr, also
        # from other threads; the handshake and responses go to the real stdout's buffer.
        sys.stdout.flush()
        quiet = contextlib.redirect_stdout(sys.stderr)
    with quiet:
        out.write(json.dumps(hs).encode() + b"\n")
        out.flush()
        while (req := wire.read_request(inp, width)) is not None:
            batch, seq_len = req.data.shape[:2]
            cols, capacity = checked(call(req.data, req.mode, req.seed, req.padding), batch, seq_len, hs["experts"])
            wire.write_response(out, req.id, cols, capacity, experts=hs["experts"])
            out.flush()


def _bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32: they are a float32's upper half."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


# Each dtype the reader takes: its element type in the file, and how it becomes float32.
_DTYPES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": ("<f4", lambda a: a.astype(np.float32)),
    "F16": ("<f2", lambda a: a.astype(np.float32)),
    "F64": ("<f8", lambda a: a.astype(np.float32)),
    "BF16": ("<u2", _bf16),
}


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as float32 numpy arrays (F32, F16, BF16 and F64), each
    copied out once; a bad file raises ValueError naming it.

    Read by the ``safetensors`` library where it is installed. numpy alone reads the file
    otherwise, and reads any file holding BF16: numpy is the package's only dependency (a router
    script served by :func:`run` needs nothing else), and the library's numpy API cannot return
    BF16, as numpy has no bfloat16 (safetensors v0.7.0 ``bindings/python/src/lib.rs:1441-1450``,
    ``get_pydtype`` asks for ``numpy.dtype("bfloat16")``: "data type 'bfloat16' not understood").
    """
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        return _read_with_numpy(path)
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
            if "BF16" in dtypes.values():
                return _read_with_numpy(path)
            for name, dtype in dtypes.items():
                _known_dtype(path, name, dtype)
            return {name: f.get_tensor(name).astype(np.float32, copy=False) for name in dtypes}
    except SafetensorError as e:
        raise ValueError(f"{path}: {e}") from None


def _known_dtype(path: str | os.PathLike[str], name: str, dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {dtype}, expected one of {', '.join(_DTYPES)}")


def _read_with_numpy(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """:func:`read_safetensors` by numpy alone: the file is mapped, not read whole."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise ValueError(f"{path}: a header of {n} bytes does not fit in a file of {size}")
        header = json.loads(f.read(n))
    start_of_body = 8 + n
    body = (np.memmap(path, dtype=np.uint8, mode="r", offset=start_of_body) if size > start_of_body
            else np.zeros(0, dtype=np.uint8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _known_dtype(path, name, info["dtype"])
        dtype, to_f32 = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= body.size:
            raise ValueError(f"{path}: tensor {name} has bytes {start}..{end}, past the file's {body.size}")
        shape = [int(d) for d in info["shape"]]
        if end - start != np.dtype(dtype).itemsize * math.prod(shape):
            raise ValueError(f"{path}: tensor {name} of shape {shape} and dtype {info['dtype']} has "
                             f"{end - start} bytes, not {np.dtype(dtype).itemsize * math.prod(shape)}")
        raw = np.frombuffer(body[start:end], dtype=dtype)
        out[name] = to_f32(raw).reshape(shape)
    del body  # closes the map: every tensor is a copy
    return out


def answer_plan(route: RouteFn, directory: str | os.PathLike[str], protocol: Protocol = v2.PROTOCOL) -> None:
    """Answers every call of DIR/manifest.json, in order, into DIR/decisions.jsonl (JSON lines;
    with ``moe-audit/2`` a capacity keeps its scope)."""
    with open(f"{directory}/manifest.json") as f:
        manifest = json.load(f)
    inputs = read_safetensors(f"{directory}/inputs.safetensors")
    experts = manifest["router"]["experts"]
    call = _caller(route)
    field = v2.capacity_field if protocol_name(protocol) == v2.PROTOCOL else v1.capacity_list
    # Written beside and renamed into place: a router that fails leaves no partial answers.
    partial = f"{directory}/decisions.jsonl.partial"
    try:
        with contextlib.redirect_stdout(sys.stderr), open(partial, "w") as out:
            for c in manifest["calls"]:
                data = inputs[c["tensor"]]
                cols, capacity = checked(call(data, c["mode"], None, None), data.shape[0], data.shape[1], experts)
                out.write(v1.line(c["id"], cols, field(capacity, experts)) + "\n")
        os.replace(partial, f"{directory}/decisions.jsonl")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


def _plan_directory(argv: Sequence[str] | None) -> str | None:
    """The DIR of ``--answer-plan DIR``. ``argv`` given: it holds this adapter's arguments only,
    parsed strictly (``--help`` too). None: the script's command line, which may hold the script's
    own options; only ``--answer-plan DIR`` (or ``--answer-plan=DIR``) is read from it, everything
    else is left to the script (moe-audit starts a router command with no arguments of its own)."""
    parser = argparse.ArgumentParser(
        description="Serves the router to moe-audit on stdin/stdout (docs/PROTOCOL.md).",
        add_help=argv is not None, allow_abbrev=False)
    parser.add_argument("--answer-plan", metavar="DIR",
                        help="answer the trace plan in DIR (moe-audit plan) into DIR/decisions.jsonl instead")
    args = parser.parse_args(argv) if argv is not None else parser.parse_known_args(sys.argv[1:])[0]
    directory: str | None = args.answer_plan
    return directory


def run(route: RouteFn, name: str, experts: int, top_k: int | None, input: str = "logits",
        hidden_size: int | None = None, argv: Sequence[str] | None = None,
        protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False, seed_calls: bool | None = None) -> None:
    """Serves the router, or with ``--answer-plan DIR`` answers a trace plan. Other arguments on
    the script's command line are the script's own: left alone (see :func:`_plan_directory`).
    ``seed_calls``: for an adapter that applies the request's seed itself (see :func:`handshake`);
    a route function leaves it None and takes a ``seed`` keyword instead."""
    directory = _plan_directory(argv)
    if directory is not None:
        answer_plan(route, directory, protocol)
    else:
        serve(route, name, experts, top_k, input, hidden_size, protocol=protocol, padding_mask=padding_mask,
              seed_calls=seed_calls)
