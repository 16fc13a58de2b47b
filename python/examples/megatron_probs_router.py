"""A Megatron-LM-style token-dropping router (drop policy "probs"), fed logits.

Softmax over all experts, top-2, capacity C = ceil(T * k / E * cf) over all T tokens of the
call, each expert keeping its C routes with the largest gate (ties to the lower token index);
gates are not renormalised after dropping. A later, stronger token evicts an earlier one and C
depends on T, so moe-audit finds leaks on P, F, N and R, and on L (split over ranks, each rank's
tokens compete for a smaller capacity of their own):

    moe-audit check --router-cmd "python3 python/examples/megatron_probs_router.py"   # exit 1: P F N R L leak
"""

import math

import numpy as np

from moe_audit import routes_from_arrays, run

EXPERTS, TOP_K, CAPACITY_FACTOR = 8, 2, 1.0


def route(data, mode):
    logits = data.reshape(-1, EXPERTS).astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
    gates = np.take_along_axis(probs, top, axis=1)
    tokens = len(logits)
    capacity = math.ceil(tokens * TOP_K / EXPERTS * CAPACITY_FACTOR)
    kept = np.zeros(top.shape, dtype=bool)
    for e in range(EXPERTS):
        rows, slots = np.nonzero(top == e)
        # Largest gate first, ties to the lower token index.
        order = np.lexsort((rows, -gates[rows, slots]))[:capacity]
        kept[rows[order], slots[order]] = True
    return routes_from_arrays(top, gates, kept), [capacity] * EXPERTS


if __name__ == "__main__":
    run(route, name="megatron-probs-py", experts=EXPERTS, top_k=TOP_K, input="logits")
