"""moe-audit/2: a JSON header line, then little-endian binary frames (docs/PROTOCOL.md,
"moe-audit/2"). Requests carry the data as float32 bytes, a seed and optionally a padding mask;
responses are binary: counts, experts, weights and kept flags, plus a capacity with its scope."""

from __future__ import annotations

import json
from typing import Any, BinaryIO

import numpy as np

from . import v1
from .v1 import Columns, Request

PROTOCOL = "moe-audit/2"


def handshake(hs: dict[str, Any], padding_mask: bool) -> dict[str, Any]:
    """The /2 handshake: binary responses, and the padding mask when the router takes one."""
    hs = dict(hs, responses="binary")
    if padding_mask:
        hs["padding_mask"] = True
    return hs


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    buf = stream.read(n)
    if buf is None or len(buf) != n:
        raise EOFError(f"{PROTOCOL}: a payload of {n} bytes ended after {0 if buf is None else len(buf)}")
    return buf


def read_request(stream: BinaryIO, width: int) -> Request | None:
    """The next request from a binary stream, or None at its end."""
    for line in stream:
        if not line.strip():
            continue
        h = json.loads(line)
        b, s = h["batch"], h["seq_len"]
        if h["width"] != width:
            raise ValueError(f"{PROTOCOL}: request {h['id']} has width {h['width']}, the handshake {width}")
        n = b * s * width
        expected = 4 * n + (b * s if h["padding"] else 0)
        if h["bytes"] != expected:
            raise ValueError(f"{PROTOCOL}: request {h['id']} says {h['bytes']} bytes, expected {expected}")
        payload = _read_exactly(stream, expected)
        data = np.frombuffer(payload, dtype="<f4", count=n).reshape(b, s, width)
        padding = None
        if h["padding"]:
            padding = np.frombuffer(payload, dtype=np.uint8, offset=4 * n).reshape(b, s).astype(bool)
        return Request(h["id"], h["mode"], data, h["seed"], padding, h.get("placement"))
    return None


def capacity_field(capacity: Any, experts: int) -> None | list[int] | dict[str, Any]:
    """A capacity as /2 states it: None, E counts for the call, or a scope with its groups (an int
    is the same count for every expert; a wrong form raises, naming the accepted ones)."""
    return v1.capacity_form(capacity, experts)


def response(request_id: int, columns: Columns, capacity: Any, experts: int,
             placement: list[int] | None = None, output: np.ndarray | None = None) -> tuple[bytes, bytes]:
    """The header line (with its newline) and the payload of a binary response; a layer run
    over ranks adds the placement it used (the rank of each sequence) and its output rows [T, H]."""
    count, expert, weight, kept = columns
    parts = [
        np.ascontiguousarray(count, dtype="<u4").tobytes(),
        np.ascontiguousarray(expert, dtype="<i4").tobytes(),
        np.ascontiguousarray(weight, dtype="<f4").tobytes(),
        np.ascontiguousarray(kept, dtype=np.uint8).tobytes(),
    ]
    if output is not None:
        parts.append(np.ascontiguousarray(output, dtype="<f4").tobytes())
    payload = b"".join(parts)
    ranks = None if placement is None else max(placement, default=-1) + 1
    header: dict[str, Any] = {"id": request_id, "routes": int(len(expert)),
                              "capacity": v1.capacity_form(capacity, experts, ranks)}
    if placement is not None:
        header["placement"] = [int(r) for r in placement]
    header["bytes"] = len(payload)
    return json.dumps(header, allow_nan=False).encode() + b"\n", payload


def write_response(stream: BinaryIO, request_id: int, columns: Columns, capacity: Any, experts: int,
                   placement: list[int] | None = None, output: np.ndarray | None = None) -> None:
    """Writes one binary response (header line, then payload) to a binary stream."""
    header, payload = response(request_id, columns, capacity, experts, placement, output)
    stream.write(header)
    stream.write(payload)
