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
dropping. ``capacity`` is None (dropless), one slot count per expert for the whole call, or
``{"scope": "sequence" | "batch" | "tokens:N", "slots": [...]}`` (one count per group; needs
``moe-audit/2``). Returning the routes alone means ``capacity = None``. A ``route`` that takes
``seed`` or ``padding`` keywords gets them (``moe-audit/2``: the audit's seed, and the padding
mask ``[batch, seq_len]`` bool or None).

``python3 my_router.py`` serves the router on stdin/stdout (``moe-audit check --router-cmd``);
``python3 my_router.py --answer-plan DIR`` answers a trace plan (``moe-audit plan``) instead,
writing ``DIR/decisions.jsonl``. Only numpy is needed. While ``route`` runs, ``print`` goes to
stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import struct
import sys
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._wire import v1, v2
from ._wire.v1 import Columns

#: The protocols' names, for ``protocol=`` (``1`` and ``2`` work too).
PROTOCOL_V1: str = v1.PROTOCOL
PROTOCOL_V2: str = v2.PROTOCOL
PROTOCOLS = {v1.PROTOCOL: v1, v2.PROTOCOL: v2}

#: A protocol as a router may name it: 1, 2, "moe-audit/1" or "moe-audit/2".
Protocol = Union[int, str]
#: One route: (expert, weight, kept), or a dict with those keys.
Route = Union[Tuple[int, float, bool], Dict[str, Any]]
#: A route function's tokens: :class:`Routes`, or a list of routes per token.
Tokens = Union["Routes", Sequence[Sequence[Route]]]
#: A capacity: None (dropless), one slot count per expert, or ``{"scope": ..., "slots": [...]}``.
Capacity = Union[None, Sequence[int], Dict[str, Any]]
#: ``route(data, mode)`` (optionally with ``seed`` and ``padding`` keywords): tokens, or
#: (tokens, capacity).
RouteFn = Callable[..., Union[Tokens, Tuple[Tokens, Capacity]]]


def protocol_name(protocol: Protocol) -> str:
    """The protocol's name: 1, 2, "moe-audit/1" or "moe-audit/2" (what a router may pass)."""
    name = {1: v1.PROTOCOL, 2: v2.PROTOCOL}.get(protocol, protocol)
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be 1 or 2 ({', '.join(PROTOCOLS)}), got {protocol!r}")
    return name


class Routes:
    """Every token's routes as ``[T, k]`` arrays: expert ids, weights, kept flags, and which
    routes exist (all, unless some tokens have fewer, such as padding left unrouted).

    A sequence of tokens, each a list of ``(expert, weight, kept)`` tuples, for code that reads
    routes one token at a time; the protocol encoders take the arrays as they are.
    """

    def __init__(self, experts: Any, weights: Any, kept: Any = None, present: Any = None) -> None:
        self.experts = np.asarray(experts, dtype=np.int64)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.kept = np.ones(self.experts.shape, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)
        self.present = None if present is None else np.broadcast_to(np.asarray(present, dtype=bool), self.experts.shape)
        if not (self.experts.ndim == 2 and self.experts.shape == self.weights.shape == self.kept.shape):
            raise ValueError(
                f"experts, weights and kept must be [tokens, k] arrays of one shape, got "
                f"{self.experts.shape}, {self.weights.shape}, {self.kept.shape}"
            )

    def __len__(self) -> int:
        return len(self.experts)

    def __getitem__(self, t: int) -> List[Tuple[int, float, bool]]:
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


def routes_from_arrays(experts: Any, weights: Any, kept: Any = None, present: Any = None) -> Routes:
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


def _split(result: Any) -> Tuple[Tokens, Capacity]:
    """(tokens, capacity) of what a route function returned."""
    return result if isinstance(result, tuple) else (result, None)


def _caller(route: RouteFn) -> Callable[[np.ndarray, str, Optional[int], Optional[np.ndarray]], Any]:
    """route as f(data, mode, seed, padding): the keywords it does not take are dropped."""
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


def describe(router: Any, options: Dict[str, Any]) -> Tuple[RouteFn, Dict[str, Any]]:
    """(route, spec) of a router given as a function or an object with a ``route`` method: spec
    holds name, experts, top_k, input, hidden_size, protocol and padding_mask, each taken (and
    removed) from the options dict, else the router's attribute of that name, else its default."""
    route = getattr(router, "route", router)
    if not callable(route):
        raise TypeError("router must be route(data, mode) or have a route(data, mode) method")
    defaults = {"name": "router", "experts": None, "top_k": None, "input": "logits", "hidden_size": None,
                "protocol": v2.PROTOCOL, "padding_mask": False}
    spec: Dict[str, Any] = {}
    for key, default in defaults.items():
        value = options.pop(key, getattr(router, key, None))
        spec[key] = default if value is None else value
    if spec["experts"] is None:
        raise TypeError("experts is required (a keyword, or an attribute of the router)")
    return route, spec


def handshake(name: str, experts: int, top_k: Optional[int], input: str, hidden_size: Optional[int],
              protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False) -> Dict[str, Any]:
    """The handshake object of a router (checked here, so a mistake fails before moe-audit runs)."""
    protocol = protocol_name(protocol)
    if input not in ("logits", "hidden"):
        raise ValueError("input must be 'logits' or 'hidden'")
    if input == "hidden" and not hidden_size:
        raise ValueError("input='hidden' needs hidden_size")
    hs: Dict[str, Any] = {"protocol": protocol, "name": name, "experts": int(experts),
          "top_k": None if top_k is None else int(top_k), "input": input}
    if hidden_size is not None:
        hs["hidden_size"] = int(hidden_size)
    return PROTOCOLS[protocol].handshake(hs, padding_mask)


def serve(route: RouteFn, name: str, experts: int, top_k: Optional[int], input: str = "logits",
          hidden_size: Optional[int] = None, stdin: Optional[BinaryIO] = None, stdout: Optional[BinaryIO] = None,
          protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False) -> None:
    """Speaks the protocol on binary streams (default stdin/stdout) until the input closes."""
    hs = handshake(name, experts, top_k, input, hidden_size, protocol, padding_mask)
    wire = PROTOCOLS[hs["protocol"]]
    width = hs["experts"] if input == "logits" else hs["hidden_size"]
    inp = stdin or sys.stdin.buffer
    out = stdout or sys.stdout.buffer
    call = _caller(route)
    out.write(json.dumps(hs).encode() + b"\n")
    out.flush()
    # While the router runs, print() must not reach the protocol stream.
    quiet = contextlib.redirect_stdout(sys.stderr) if stdout is None else contextlib.nullcontext()
    with quiet:
        while (req := wire.read_request(inp, width)) is not None:
            tokens, capacity = _split(call(req.data, req.mode, req.seed, req.padding))
            wire.write_response(out, req.id, columns(tokens), capacity, experts=hs["experts"])
            out.flush()


def _bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32: they are a float32's upper half."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


# Each dtype the reader takes: its element type in the file, and how it becomes float32.
_DTYPES: Dict[str, Tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": ("<f4", lambda a: a.astype(np.float32)),
    "F16": ("<f2", lambda a: a.astype(np.float32)),
    "F64": ("<f8", lambda a: a.astype(np.float32)),
    "BF16": ("<u2", _bf16),
}


def read_safetensors(path: Union[str, "os.PathLike[str]"]) -> Dict[str, np.ndarray]:
    """Tensors of a safetensors file as float32 numpy arrays (F32, F16, BF16 and F64; numpy
    alone). The file is mapped, not read whole: each tensor is copied out once, as float32."""
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
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, expected one of {', '.join(_DTYPES)}")
        dtype, to_f32 = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= body.size:
            raise ValueError(f"{path}: tensor {name} has bytes {start}..{end}, past the file's {body.size}")
        raw = np.frombuffer(body[start:end], dtype=dtype)
        out[name] = to_f32(raw).reshape(info["shape"])
    del body  # closes the map: every tensor is a copy
    return out


def answer_plan(route: RouteFn, directory: Union[str, "os.PathLike[str]"], protocol: Protocol = v2.PROTOCOL) -> None:
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
                tokens, capacity = _split(call(inputs[c["tensor"]], c["mode"], None, None))
                out.write(v1.line(c["id"], columns(tokens), field(capacity, experts)) + "\n")
        os.replace(partial, f"{directory}/decisions.jsonl")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


def run(route: RouteFn, name: str, experts: int, top_k: Optional[int], input: str = "logits",
        hidden_size: Optional[int] = None, argv: Optional[Sequence[str]] = None,
        protocol: Protocol = v2.PROTOCOL, padding_mask: bool = False) -> None:
    """Serves the router, or with ``--answer-plan DIR`` answers a trace plan."""
    parser = argparse.ArgumentParser(
        description=f"Serves the router {name} to moe-audit on stdin/stdout (docs/PROTOCOL.md).")
    parser.add_argument("--answer-plan", metavar="DIR",
                        help="answer the trace plan in DIR (moe-audit plan) into DIR/decisions.jsonl instead")
    args = parser.parse_args(argv)
    if args.answer_plan is not None:
        answer_plan(route, args.answer_plan, protocol)
    else:
        serve(route, name, experts, top_k, input, hidden_size, protocol=protocol, padding_mask=padding_mask)
