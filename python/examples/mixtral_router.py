"""A Mixtral-style router: a bias-free gate on hidden states, top-2, softmax over the two.

Token choice without capacity: each token's routing depends on its own hidden state only, so
moe-audit finds no leak:

    moe-audit check --router-cmd "python3 python/examples/mixtral_router.py"   # exit 0
"""

import numpy as np

from moe_audit import routes_from_arrays, run

EXPERTS, TOP_K, HIDDEN = 8, 2, 32
# A fixed gate, seeded so every run routes alike.
GATE = np.random.default_rng(0).standard_normal((EXPERTS, HIDDEN)).astype(np.float32) / np.sqrt(HIDDEN)


def route(data, mode):
    logits = data.reshape(-1, HIDDEN) @ GATE.T  # [T, E]
    # Ties to the lowest expert id: a stable sort of the negated logits.
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    chosen = np.take_along_axis(logits, top, axis=1)
    gates = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    gates /= gates.sum(axis=1, keepdims=True)
    return routes_from_arrays(top, gates), None


if __name__ == "__main__":
    run(route, name="mixtral-py", experts=EXPERTS, top_k=TOP_K, input="hidden", hidden_size=HIDDEN)
