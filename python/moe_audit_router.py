"""Serve a Python MoE router to moe-audit over the moe-audit/1 protocol (docs/PROTOCOL.md).

Write a function ``route(data, mode)`` and hand it to :func:`run`::

    import numpy as np
    from moe_audit_router import run

    def route(data, mode):
        # data: float32 array [batch, seq_len, width] (width = experts for input="logits",
        # hidden_size for input="hidden"); mode: "train" or "inference".
        ...
        return tokens, capacity

    run(route, name="my-router", experts=8, top_k=2, input="logits")

``tokens`` lists, for each of the batch*seq_len tokens in sequence-major order (token
``b * seq_len + s``), its routes in choice order as ``(expert, weight, kept)`` tuples (or dicts
with those keys); ``weight`` is the combine weight, or for a dropped route the gate it had
before dropping. ``capacity`` is None (dropless) or one slot count per expert for the call.
:func:`routes_from_arrays` builds ``tokens`` from numpy arrays. Returning ``tokens`` alone means
``capacity = None``.

``python3 my_router.py`` serves the router on stdin/stdout (``moe-audit check --router-cmd``);
``python3 my_router.py --answer-plan DIR`` answers a trace plan (``moe-audit plan``) instead,
writing ``DIR/decisions.jsonl``. Only numpy is needed.

While ``route`` runs, ``print`` goes to stderr: stdout carries the protocol only.
"""

import json
import struct
import sys

import numpy as np

PROTOCOL = "moe-audit/1"


def routes_from_arrays(experts, weights, kept=None):
    """tokens from arrays [T, k]: expert ids, weights, and kept flags (all kept when None)."""
    experts = np.asarray(experts)
    weights = np.asarray(weights, dtype=np.float64)
    kept = np.ones(experts.shape, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)
    return [
        [(int(e), float(w), bool(k)) for e, w, k in zip(er, wr, kr)]
        for er, wr, kr in zip(experts, weights, kept)
    ]


def _response(request_id, result):
    tokens, capacity = result if isinstance(result, tuple) else (result, None)
    out = []
    for token in tokens:
        row = []
        for r in token:
            expert, weight, kept = (r["expert"], r["weight"], r["kept"]) if isinstance(r, dict) else r
            row.append({"expert": int(expert), "weight": float(weight), "kept": bool(kept)})
        out.append(row)
    cap = None if capacity is None else [int(c) for c in capacity]
    return json.dumps({"id": request_id, "tokens": out, "capacity": cap}, allow_nan=False)


def _handshake(name, experts, top_k, input, hidden_size):
    if input not in ("logits", "hidden"):
        raise ValueError("input must be 'logits' or 'hidden'")
    if input == "hidden" and not hidden_size:
        raise ValueError("input='hidden' needs hidden_size")
    hs = {"protocol": PROTOCOL, "name": name, "experts": int(experts), "top_k": top_k, "input": input}
    if hidden_size is not None:
        hs["hidden_size"] = int(hidden_size)
    return hs


def serve(route, name, experts, top_k, input="logits", hidden_size=None, stdin=None, stdout=None):
    """Speaks moe-audit/1 on stdin/stdout until stdin closes."""
    stdin = stdin or sys.stdin
    protocol_out = stdout or sys.stdout
    hs = _handshake(name, experts, top_k, input, hidden_size)
    width = hs["experts"] if input == "logits" else hs["hidden_size"]
    protocol_out.write(json.dumps(hs) + "\n")
    protocol_out.flush()
    user_out, sys.stdout = sys.stdout, sys.stderr
    try:
        for line in stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            data = np.asarray(req["data"], dtype=np.float32).reshape(req["batch"], req["seq_len"], width)
            protocol_out.write(_response(req["id"], route(data, req["mode"])) + "\n")
            protocol_out.flush()
    finally:
        sys.stdout = user_out


def read_safetensors(path):
    """Tensors of a safetensors file as numpy arrays (F32, F16 and F64 only; numpy alone)."""
    dtypes = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        body = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = dtypes[info["dtype"]]
        out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(info["shape"]).astype(np.float32)
    return out


def answer_plan(route, directory):
    """Answers every call of DIR/manifest.json, in order, into DIR/decisions.jsonl."""
    with open(f"{directory}/manifest.json") as f:
        manifest = json.load(f)
    inputs = read_safetensors(f"{directory}/inputs.safetensors")
    user_out, sys.stdout = sys.stdout, sys.stderr
    try:
        with open(f"{directory}/decisions.jsonl", "w") as out:
            for call in manifest["calls"]:
                data = inputs[call["tensor"]]
                out.write(_response(call["id"], route(data, call["mode"])) + "\n")
    finally:
        sys.stdout = user_out


def run(route, name, experts, top_k, input="logits", hidden_size=None, argv=None):
    """Serves the router, or with ``--answer-plan DIR`` answers a trace plan."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--answer-plan"] and len(argv) == 2:
        answer_plan(route, argv[1])
    elif argv:
        sys.exit(f"usage: {sys.argv[0]} [--answer-plan DIR]")
    else:
        serve(route, name, experts, top_k, input, hidden_size)
