"""A fake MoE layer run expert-parallel over RANKS ranks, speaking moe-audit/2 frames directly
(struct/numpy, no torch): handshake `ranks`, `output`, request `placement`, binary responses with
the placement, a `rank`-scoped capacity and the output rows (docs/PROTOCOL.md).

Each rank routes its local micro-batch (its sequences in ascending batch order) as Megatron-Core
does with a capacity: softmax top-k, capacity C = ceil(T_local * k / E * CF) per expert on each
rank, drop policy `probs` (an expert keeps the C routes of highest probability on that rank).
The output of a token is sum over kept routes of gate * (x @ W_e).

The same layer at another expert-parallel size is the same script with another RANKS (one
launch each, as EP 1, 2 and 4 are under torch.distributed.run): the weights and the routing math
are the same, only the tokens each rank counts its capacity over differ. RANKS=0 is the layer in
one process that declares no `ranks` (an in-process EP 1: no placement, the capacity stated for
the whole call).

Environment: RANKS (2; 0: not ranked), VARIANT capacity | dropless | meanrow (dropless routes; the output adds
the mean hidden row of the token's rank: batch-mates leak through the output only), DEFAULT
contiguous | strided (the placement when a request sends none), HS (JSON merged into the
handshake), BAD (one malformed response: no-placement, unbalanced, other-placement, slots,
nonfinite, short), FAULT rank | hang (the second request fails as a rank would)."""

import json
import math
import os
import struct
import sys
import time

import numpy as np

RANKED = os.environ.get("RANKS", "2") != "0"
RANKS = max(int(os.environ.get("RANKS", "2")), 1)
VARIANT = os.environ.get("VARIANT", "capacity")
DEFAULT = os.environ.get("DEFAULT", "contiguous")
BAD = os.environ.get("BAD", "")
FAULT = os.environ.get("FAULT", "")
E, K, H, CF = 4, 2, 8, 1.0

rng = np.random.default_rng(0)
W_GATE = rng.standard_normal((H, E)).astype(np.float32)
W_EXPERT = (rng.standard_normal((E, H, H)) / math.sqrt(H)).astype(np.float32)

out = sys.stdout.buffer
hs = {"protocol": "moe-audit/2", "name": "ranked", "experts": E, "top_k": K, "input": "hidden",
      "hidden_size": H, "responses": "binary", "ranks": RANKS, "output": "float32", "weights": "00ff"}
if not RANKED:
    del hs["ranks"]
hs.update(json.loads(os.environ.get("HS", "{}")))
out.write(json.dumps(hs).encode() + b"\n")
out.flush()


def default_placement(b):
    per = b // RANKS
    return [i // per if DEFAULT == "contiguous" else i % RANKS for i in range(b)]


def route_rank(x):
    """One rank's local tokens x [T, H]: experts, weights, kept [T, K]; output [T, H]; capacity."""
    logits = x @ W_GATE
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :K]
    weights = np.take_along_axis(probs, experts, axis=1)
    kept = np.ones_like(experts, dtype=bool)
    capacity = None
    if VARIANT == "capacity":
        capacity = math.ceil(len(x) * K / E * CF)
        for e in range(E):
            t, j = np.nonzero(experts == e)
            order = sorted(range(len(t)), key=lambda i: (-weights[t[i], j[i]], t[i]))
            for i in order[capacity:]:
                kept[t[i], j[i]] = False
    y = np.zeros_like(x)
    for t in range(len(x)):
        for j in range(K):
            if kept[t, j]:
                y[t] += weights[t, j] * (x[t] @ W_EXPERT[experts[t, j]])
    if VARIANT == "meanrow":
        y += x.mean(axis=0)
    return experts, weights, kept, y, capacity


n = 0
for line in sys.stdin.buffer:
    if not line.strip():
        continue
    n += 1
    h = json.loads(line)
    b, s, w = h["batch"], h["seq_len"], h["width"]
    payload = sys.stdin.buffer.read(h["bytes"])
    x = np.frombuffer(payload, dtype="<f4", count=b * s * w).reshape(b, s, w)
    if n == 2 and FAULT:
        if FAULT == "rank":
            sys.stderr.write("moe-audit: rank 1: RuntimeError: expert 3 overflowed\n")
        else:
            sys.stderr.write(f"moe-audit: rank 1: did not answer call 2 within {os.environ['MOE_AUDIT_TIMEOUT']} s\n")
        sys.stderr.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ranked.py FAILED\n")
        sys.stderr.flush()
        sys.exit(1)
    placement = h.get("placement") or default_placement(b)
    experts = np.zeros((b * s, K), dtype=np.int64)
    weights = np.zeros((b * s, K), dtype=np.float32)
    kept = np.zeros((b * s, K), dtype=bool)
    y = np.zeros((b * s, H), dtype=np.float32)
    slots = []
    for r in range(RANKS):
        seqs = [i for i in range(b) if placement[i] == r]
        idx = np.concatenate([np.arange(i * s, (i + 1) * s) for i in seqs])
        ex, wt, kp, yr, c = route_rank(x.reshape(b * s, w)[idx])
        experts[idx], weights[idx], kept[idx], y[idx] = ex, wt, kp, yr
        slots.append(c)
    capacity = None if VARIANT != "capacity" else {"scope": "rank" if RANKED else "batch", "slots": slots}
    stated = list(placement)
    if BAD == "no-placement":
        stated = None
    elif BAD == "unbalanced":
        stated = [0] * b
    elif BAD == "other-placement" and "placement" in h:
        stated = default_placement(b)
    elif BAD == "slots":
        capacity = {"scope": "rank", "slots": [s] * (RANKS + 1)}
    elif BAD == "nonfinite":
        y[0, 0] = np.nan
    body = b"".join((
        np.full(b * s, K, dtype="<u4").tobytes(),
        experts.astype("<i4").tobytes(),
        weights.astype("<f4").tobytes(),
        kept.astype(np.uint8).tobytes(),
        y.astype("<f4").tobytes(),
    ))
    if BAD == "short":
        body = body[:-4 * b * s * H]
    header = {"id": h["id"], "routes": b * s * K, "capacity": capacity, "bytes": len(body)}
    if stated is not None and RANKED:
        header["placement"] = stated
    out.write(json.dumps(header).encode() + b"\n" + body)
    out.flush()
