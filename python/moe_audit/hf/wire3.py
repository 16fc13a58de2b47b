"""moe-audit/3, the model side: token ids in, every routed layer's record (and output rows) out.

Handshake line, then per call a JSON header line and exactly ``bytes`` little-endian bytes
(docs/PROTOCOL.md, "moe-audit/3"). Request payload: ``batch*seq_len`` u32 token ids
(sequence-major), then with ``padding`` as many u8 (1 = padding). Response payload, per layer in
handshake order: count T u32, expert R i32, weight R f32, kept R u8, then with ``logits`` T*E f32;
after all layers, with ``outputs`` D > 0, T*D f32 rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from .._wire import v2

if TYPE_CHECKING:
    from .routers import Decoded

PROTOCOL = "moe-audit/3"
#: The largest request payload read (token ids and mask): 256 MiB.
MAX_REQUEST_BYTES = 1 << 28
_REQUEST_FIELDS = {"id", "mode", "batch", "seq_len", "seed", "padding", "path", "prefill", "bytes"}


@dataclass
class Request:
    id: int
    mode: str
    ids: np.ndarray  # int64 [batch, seq_len]
    seed: int
    padding: np.ndarray | None  # bool [batch, seq_len]
    path: str
    prefill: int


def handshake(name: str, vocab: int, layers: list[dict[str, Any]], outputs: int, logits: bool,
              padding_mask: bool = True, generate: bool = True) -> dict[str, Any]:
    """The handshake object; layers: [{"layer", "kind", "experts", "top_k"}] (dense: no experts)."""
    return {"protocol": PROTOCOL, "name": name, "vocab": int(vocab), "layers": layers, "outputs": int(outputs),
            "logits": bool(logits), "padding_mask": bool(padding_mask), "generate": bool(generate)}


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    buf = stream.read(n)
    if buf is None or len(buf) != n:
        raise EOFError(f"{PROTOCOL}: a payload of {n} bytes ended after {0 if buf is None else len(buf)}")
    return buf


def _bad(h: dict[str, Any], what: str) -> ValueError:
    return ValueError(f"{PROTOCOL}: request {h.get('id', '?')}: {what}")


def read_request(stream: BinaryIO, vocab: int) -> Request | None:
    """The next request, or None at the end of the stream. Raises ValueError on a malformed one."""
    for line in stream:
        if not line.strip():
            continue
        h = json.loads(line)
        if not isinstance(h, dict) or set(h) - _REQUEST_FIELDS or not {"id", "batch", "seq_len", "bytes"} <= set(h):
            raise ValueError(f"{PROTOCOL}: a request header must have the fields {sorted(_REQUEST_FIELDS)}: "
                             f"{line[:200]!r}")
        b, s = h["batch"], h["seq_len"]
        if not (isinstance(b, int) and isinstance(s, int) and b > 0 and s > 0):
            raise _bad(h, f"batch and seq_len must be positive integers, got {b!r}, {s!r}")
        padding = bool(h.get("padding", False))
        expected = b * s * 4 + (b * s if padding else 0)
        if expected > MAX_REQUEST_BYTES:
            raise _bad(h, f"{expected} bytes is over the bound of {MAX_REQUEST_BYTES}")
        if h["bytes"] != expected:
            raise _bad(h, f"says {h['bytes']} bytes, expected {expected}")
        path, prefill = h.get("path", "forward"), h.get("prefill", 0)
        if path not in ("forward", "generate"):
            raise _bad(h, f"path must be 'forward' or 'generate', got {path!r}")
        if not (isinstance(prefill, int) and 0 <= prefill <= s):
            raise _bad(h, f"prefill must be in 0..={s}, got {prefill!r}")
        mode = h.get("mode", "train")
        if mode not in ("train", "inference", "eval"):
            raise _bad(h, f"mode must be 'train' or 'inference', got {mode!r}")
        payload = _read_exactly(stream, expected)
        ids = np.frombuffer(payload, dtype="<u4", count=b * s).astype(np.int64).reshape(b, s)
        if ids.size and int(ids.max()) >= vocab:
            t = int(np.argmax(ids.reshape(-1) >= vocab))
            raise _bad(h, f"token id {int(ids.reshape(-1)[t])} at sequence {t // s}, position {t % s} is not "
                          f"below the vocabulary size {vocab}")
        mask = None
        if padding:
            mask = np.frombuffer(payload, dtype=np.uint8, offset=b * s * 4).reshape(b, s).astype(bool)
        return Request(h["id"], mode, ids, int(h.get("seed", 0)), mask, path, prefill)
    return None


def response(request_id: int, layers: list[tuple[int, tuple[Decoded, int]]], outputs: np.ndarray | None,
             logits: bool) -> tuple[bytes, bytes]:
    """(header line, payload) of a response. layers: [(Decoded, experts E)] in handshake order;
    outputs: float32 [T, D] or None."""
    parts: list[bytes] = []
    header_layers: list[dict[str, Any]] = []
    for layer, (decoded, experts) in layers:
        present = decoded.experts >= 0
        count = present.sum(axis=1)
        parts += [np.ascontiguousarray(count, dtype="<u4").tobytes(),
                  np.ascontiguousarray(decoded.experts[present], dtype="<i4").tobytes(),
                  np.ascontiguousarray(decoded.weights[present], dtype="<f4").tobytes(),
                  np.ascontiguousarray(decoded.kept[present], dtype=np.uint8).tobytes()]
        if logits:
            assert decoded.logits is not None, "a layer without logits in a response with logits"
            # [T, E]: a router that also scores a skip expert (ZAYA: E + 1) sends the E routed ones.
            parts.append(np.ascontiguousarray(decoded.logits[:, :experts], dtype="<f4").tobytes())
        header_layers.append({"layer": int(layer), "routes": int(present.sum()),
                              "capacity": v2.capacity_field(decoded.capacity, experts)})
    if outputs is not None:
        parts.append(np.ascontiguousarray(outputs, dtype="<f4").tobytes())
    payload = b"".join(parts)
    header = {"id": request_id, "layers": header_layers, "bytes": len(payload)}
    return json.dumps(header, allow_nan=False).encode() + b"\n", payload


def request(request_id: int, ids: Any, mode: str = "train", seed: int = 0, padding: Any = None, path: str = "forward",
            prefill: int = 0) -> tuple[bytes, bytes]:
    """(header line, payload) of a request: what moe-audit sends (for tests and other clients)."""
    ids = np.asarray(ids)
    b, s = ids.shape
    payload = np.ascontiguousarray(ids, dtype="<u4").tobytes()
    if padding is not None:
        payload += np.ascontiguousarray(padding, dtype=np.uint8).tobytes()
    header = {"id": request_id, "mode": mode, "batch": b, "seq_len": s, "seed": seed,
              "padding": padding is not None, "path": path, "prefill": prefill, "bytes": len(payload)}
    return json.dumps(header).encode() + b"\n", payload


def read_response(stream: BinaryIO, hs: dict[str, Any]) -> dict[str, Any]:
    """A response as {"id", "layers": [{"layer", "capacity", "count", "expert", "weight", "kept",
    "logits"}], "outputs"}: the reader moe-audit implements, for tests."""
    h = json.loads(stream.readline())
    payload = _read_exactly(stream, h["bytes"])
    at = 0

    def take(dtype: Any, n: int) -> np.ndarray:
        nonlocal at
        a = np.frombuffer(payload, dtype=dtype, count=n, offset=at)
        at += a.nbytes
        return a

    routed = [entry for entry in hs["layers"] if entry["kind"] != "dense"]
    # T is not in the header: every layer has 9 bytes per route, the rest is per token.
    per_token = sum(4 + (4 * e["experts"] if hs["logits"] else 0) for e in routed) + 4 * hs["outputs"]
    tokens = (len(payload) - sum(9 * lh["routes"] for lh in h["layers"])) // per_token
    layers: list[dict[str, Any]] = []
    for entry, lh in zip(routed, h["layers"]):
        count = take("<u4", tokens)
        r = lh["routes"]
        layer = {"layer": lh["layer"], "capacity": lh["capacity"], "count": count, "expert": take("<i4", r),
                 "weight": take("<f4", r), "kept": take(np.uint8, r).astype(bool)}
        if hs["logits"]:
            layer["logits"] = take("<f4", tokens * entry["experts"]).reshape(tokens, entry["experts"])
        layers.append(layer)
    outputs = take("<f4", tokens * hs["outputs"]).reshape(tokens, hs["outputs"]) if hs["outputs"] else None
    if at != len(payload):
        raise ValueError(f"{PROTOCOL}: response {h['id']} has {len(payload) - at} bytes left over")
    return {"id": h["id"], "layers": layers, "outputs": outputs}
