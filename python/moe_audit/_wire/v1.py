"""moe-audit/1: JSON lines both ways (docs/PROTOCOL.md, "Messages")."""

from __future__ import annotations

import json
import operator
import re
import reprlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, SupportsIndex

import numpy as np

#: Routes flattened in token order: (count [T], expert [R], weight [R], kept [R]).
Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

PROTOCOL = "moe-audit/1"


@dataclass
class Request:
    """One routing call: its id, mode, data [batch, seq_len, width] float32, seed, padding
    mask and placement (the rank of each sequence, for a layer run over ranks) (``moe-audit/2``
    only; None here)."""

    id: int
    mode: str
    data: np.ndarray
    seed: int | None = None
    padding: np.ndarray | None = None
    placement: list[int] | None = None


def handshake(hs: dict[str, Any], padding_mask: bool) -> dict[str, Any]:
    """The /1 handshake: no padding mask."""
    if padding_mask:
        raise ValueError("a padding mask needs protocol moe-audit/2")
    return hs


def read_request(stream: Iterable[bytes], width: int) -> Request | None:
    """The next request from a binary stream, or None at its end."""
    for line in stream:
        if line.strip():
            req = json.loads(line)
            data = np.asarray(req["data"], dtype=np.float32).reshape(req["batch"], req["seq_len"], width)
            return Request(req["id"], req["mode"], data)
    return None


def brief(x: object) -> str:
    """x's repr shortened to one line, for an error message (moe-audit quotes stderr's last line)."""
    return " ".join(reprlib.repr(x).split())


def count(x: object) -> int | None:
    """x as an int when it is an integer (Python, numpy, or anything with ``__index__``), else
    None; a bool is no count."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, SupportsIndex):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


_SCOPE = re.compile(r"sequence|batch|tokens:[1-9][0-9]*")
_FLATTEN = ("sequence-major", "position-major")


def _capacity_error(capacity: object, experts: int, problem: str,
                    kind: type[Exception] = ValueError) -> Exception:
    return kind(
        f"moe-audit adapter: route() returned capacity {brief(capacity)}: {problem}; a capacity is None "
        f"(dropless), an int (the same slots for every expert), one int per expert ({experts} of them), "
        'or {"scope": "sequence"|"batch"|"tokens:N", "slots": [...]}'
    )


def _slots(capacity: Any, values: Any, experts: int) -> list[int]:
    """values as slot counts (ints >= 0), else an error naming the first bad one."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise _capacity_error(capacity, experts, f"slots {brief(values)} is not a list of ints", TypeError)
    out = []
    for i, v in enumerate(values):
        n = count(v)
        if n is None:
            raise _capacity_error(capacity, experts, f"slot count {i} is {brief(v)}, not an int", TypeError)
        if n < 0:
            raise _capacity_error(capacity, experts, f"slot count {i} is {n}, a negative count")
        out.append(n)
    return out


def capacity_form(capacity: Any, experts: int, ranks: int | None = None) -> None | list[int] | dict[str, Any]:
    """A capacity as route() may return it, checked: None, E slot counts (an int stands for the
    same count for every expert), or ``{"scope", "slots"[, "flatten"]}``. Anything else raises
    TypeError or ValueError naming the accepted forms. A layer run over ``ranks`` ranks may also
    state ``{"scope": "rank", "slots": [one count per rank]}``."""
    if capacity is None:
        return None
    if ranks is not None and isinstance(capacity, dict) and capacity.get("scope") == "rank":
        slots = _slots(capacity, capacity.get("slots"), experts)
        if len(slots) != ranks or set(capacity) != {"scope", "slots"}:
            raise _capacity_error(capacity, experts, f"a rank scope holds exactly one slot count per rank ({ranks})")
        return {"scope": "rank", "slots": slots}
    if isinstance(capacity, dict):
        missing = [k for k in ("scope", "slots") if k not in capacity]
        if missing:
            raise _capacity_error(capacity, experts, f"no {' or '.join(map(repr, missing))} key")
        extra = sorted(map(str, set(capacity) - {"scope", "slots", "flatten"}))
        if extra:
            raise _capacity_error(capacity, experts, f"unknown key {', '.join(map(repr, extra))}")
        scope = capacity["scope"]
        if not isinstance(scope, str) or not _SCOPE.fullmatch(scope):
            raise _capacity_error(capacity, experts,
                                  f"scope {brief(scope)} is not 'sequence', 'batch' or 'tokens:N' (N >= 1)")
        out = {"scope": scope, "slots": _slots(capacity, capacity["slots"], experts)}
        if "flatten" in capacity:
            if capacity["flatten"] not in _FLATTEN:
                raise _capacity_error(capacity, experts, f"flatten {brief(capacity['flatten'])} is not "
                                      "'sequence-major' or 'position-major'")
            out["flatten"] = capacity["flatten"]
        return out
    n = count(capacity)
    if n is not None:
        if n < 0:
            raise _capacity_error(capacity, experts, "a negative count")
        return [n] * experts
    # A float is refused even when whole: rounding it (ceil or floor) is the router's choice.
    if isinstance(capacity, (str, bytes)) or not hasattr(capacity, "__len__") or getattr(capacity, "ndim", 1) != 1:
        what = f"{capacity.ndim}-D array" if isinstance(capacity, np.ndarray) else type(capacity).__name__
        raise _capacity_error(capacity, experts, f"a {what} is not a capacity", TypeError)
    if len(capacity) != experts:
        raise _capacity_error(capacity, experts, f"{len(capacity)} slot counts, not one per expert ({experts})")
    return _slots(capacity, capacity, experts)


_warned: set[str] = set()


def capacity_list(capacity: object, experts: int) -> list[int] | None:
    """A capacity as /1 states it: E slot counts for the call, or None."""
    form = capacity_form(capacity, experts)
    if not isinstance(form, dict):
        return form
    slots = form["slots"]
    if form["scope"] == "batch" and len(slots) == 1:
        return [slots[0]] * experts
    # /1 has one capacity per call: a per-sequence or per-group one can only be left out
    # (reporting B*C or C would be wrong); moe-audit/2 states it.
    if form["scope"] not in _warned:
        _warned.add(form["scope"])
        print(f"moe-audit adapter: a capacity per {form['scope']} cannot be stated in "
              f"{PROTOCOL}; reported as dropless (null), so the capacity invariant is not "
              "checked (moe-audit/2 states it)", file=sys.stderr)
    return None


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
