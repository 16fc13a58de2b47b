"""moe-audit/1: JSON lines both ways (docs/PROTOCOL.md, "Messages")."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

#: Routes flattened in token order: (count [T], expert [R], weight [R], kept [R]).
Columns = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

PROTOCOL = "moe-audit/1"


@dataclass
class Request:
    """One routing call: its id, mode, data [batch, seq_len, width] float32, seed and padding
    mask (``moe-audit/2`` only; None here)."""

    id: int
    mode: str
    data: np.ndarray
    seed: Optional[int] = None
    padding: Optional[np.ndarray] = None


def handshake(hs: Dict[str, Any], padding_mask: bool) -> Dict[str, Any]:
    """The /1 handshake: no padding mask."""
    if padding_mask:
        raise ValueError("a padding mask needs protocol moe-audit/2")
    return hs


def read_request(stream: Iterable[bytes], width: int) -> Optional[Request]:
    """The next request from a binary stream, or None at its end."""
    for line in stream:
        if line.strip():
            req = json.loads(line)
            data = np.asarray(req["data"], dtype=np.float32).reshape(req["batch"], req["seq_len"], width)
            return Request(req["id"], req["mode"], data)
    return None


_warned: Set[str] = set()


def capacity_list(capacity: Any, experts: int) -> Optional[List[int]]:
    """A capacity as /1 states it: E slot counts for the call, or None."""
    if capacity is None:
        return None
    if isinstance(capacity, dict):
        slots = capacity["slots"]
        if capacity["scope"] == "batch" and len(slots) == 1:
            return [int(slots[0])] * experts
        # /1 has one capacity per call: a per-sequence or per-group one can only be left out
        # (reporting B*C or C would be wrong); moe-audit/2 states it.
        if capacity["scope"] not in _warned:
            _warned.add(capacity["scope"])
            print(f"moe-audit adapter: a capacity per {capacity['scope']} cannot be stated in "
                  f"{PROTOCOL}; reported as dropless (null), so the capacity invariant is not "
                  "checked (moe-audit/2 states it)", file=sys.stderr)
        return None
    return [int(c) for c in capacity]


def line(request_id: int, columns: Columns, capacity: Any) -> str:
    """The response line (no newline) for routes given as (count, expert, weight, kept), with
    the capacity field as it is to be written (None, a list, or /2's scoped dict)."""
    count, expert, weight, kept = columns
    ends = np.cumsum(count)
    routes = [{"expert": int(e), "weight": float(w), "kept": bool(k)} for e, w, k in zip(expert, weight, kept)]
    tokens = [routes[end - n:end] for n, end in zip(count, ends)]
    return json.dumps({"id": request_id, "tokens": tokens, "capacity": capacity}, allow_nan=False)


def response(request_id: int, columns: Columns, capacity: Any, experts: int) -> str:
    """The /1 response line (no newline): the capacity as /1 states it."""
    return line(request_id, columns, capacity_list(capacity, experts))


def write_response(stream: BinaryIO, request_id: int, columns: Columns, capacity: Any, experts: int) -> None:
    """Writes one response line to a binary stream."""
    stream.write(response(request_id, columns, capacity, experts).encode() + b"\n")
