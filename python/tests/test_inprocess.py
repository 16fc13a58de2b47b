"""moe_audit.check on a router of this process: moe-audit's messages name the router, never the
relay command that carries the protocol to it."""

import numpy as np

import moe_audit


def test_an_error_names_the_router_served_here_not_the_relay():
    def one_route(data, mode):
        # top_k is 2 in the handshake, one route per token here: moe-audit refuses the answer.
        tokens = data.shape[0] * data.shape[1]
        return moe_audit.routes_from_arrays(np.zeros((tokens, 1)), np.ones((tokens, 1)))

    proc = moe_audit.check(one_route, "--batch", "1", "--seq-len", "4", "--probes", "D", name="one-route",
                           experts=4, top_k=2)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: router `one-route (served in this Python process)`: "), proc.stderr
    assert "cat " not in proc.stderr and "moe-audit-check-" not in proc.stderr, proc.stderr
