"""A Switch-style router for the protocol tests: top-1 over logits, a fixed capacity of SLOTS
(default 6; STATED, if set, is the one reported) per expert in each sequence (each sequence's tokens compete alone, first come first
served: HF's `expert_capacity`), and padding tokens left unrouted when the request masks them.

Environment: MOE_AUDIT_PROTOCOL 1 or 2 (default 2); CAPACITY how the capacity is stated:
"sequence" (scoped, /2), "call" (B*C for the whole call, the /1 workaround) or "null";
LOG a file that gets one line per request: its mode,
seed and padding-token count; MASK=0 takes no padding mask over /2.
"""

import os

import numpy as np

from moe_audit import routes_from_arrays, run

EXPERTS = 8
SLOTS = int(os.environ.get("SLOTS", "6"))
# The capacity stated (default the true one): a lower one breaks the invariant.
STATED = int(os.environ.get("STATED", SLOTS))
STYLE = os.environ.get("CAPACITY", "sequence")
LOG = os.environ.get("LOG")


def route(data, mode, seed=None, padding=None):
    b, s, e = data.shape
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{mode} {seed} {0 if padding is None else int(padding.sum())}\n")
    logits = data.reshape(b, s, e).astype(np.float64)
    probs = np.exp(logits - logits.max(axis=2, keepdims=True))
    probs /= probs.sum(axis=2, keepdims=True)
    top = probs.argmax(axis=2)
    gate = np.take_along_axis(probs, top[..., None], axis=2)[..., 0]
    capacity = SLOTS
    kept = np.zeros((b, s), dtype=bool)
    present = np.ones((b, s), dtype=bool) if padding is None else ~padding
    for seq in range(b):
        used = np.zeros(EXPERTS, dtype=int)
        for t in range(s):
            if present[seq, t] and used[top[seq, t]] < capacity:
                used[top[seq, t]] += 1
                kept[seq, t] = True
    routes = routes_from_arrays(top.reshape(-1, 1), gate.reshape(-1, 1), kept.reshape(-1, 1),
                                present.reshape(-1, 1))
    if STYLE == "sequence":
        return routes, {"scope": "sequence", "slots": [STATED] * b}
    if STYLE == "call":
        return routes, [STATED * b] * EXPERTS
    return routes, None


if __name__ == "__main__":
    protocol = int(os.environ.get("MOE_AUDIT_PROTOCOL", "2"))
    run(route, name="switch-seq", experts=EXPERTS, top_k=1, input="logits", protocol=protocol,
        padding_mask=protocol == 2 and os.environ.get("MASK", "1") == "1")
