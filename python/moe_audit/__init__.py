"""moe_audit: Python helpers for moe-audit (https://github.com/OWNER/moe-audit).

- ``moe_audit.snapshot``: snapshot tests of a Python router's routing decisions
  (``assert_routing_snapshot(route, "tests/snapshots/router.snap", experts=8, top_k=2)``);
- the protocol adapter (``run``, ``routes_from_arrays``, ...), for now the module
  ``moe_audit_router`` beside this package, re-exported here.
"""

import os
import sys

try:
    from moe_audit_router import answer_plan, read_safetensors, routes_from_arrays, run, serve
except ImportError:  # used from a checkout: the adapter sits beside the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe_audit_router import answer_plan, read_safetensors, routes_from_arrays, run, serve

from .snapshot import SnapshotError, assert_routing_snapshot, routing_snapshot

__all__ = [
    "SnapshotError",
    "answer_plan",
    "assert_routing_snapshot",
    "read_safetensors",
    "routes_from_arrays",
    "routing_snapshot",
    "run",
    "serve",
]
