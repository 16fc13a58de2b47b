"""moe_audit: audit Mixture-of-Experts routers written in Python with the moe-audit binary.

``pip install moe-audit`` installs the ``moe-audit`` binary and this package:

- the protocol adapter: :func:`run` serves ``route(data, mode)`` to ``moe-audit check
  --router-cmd``; :func:`routes_from_arrays` builds its answer; :func:`answer_plan` answers trace
  files (``moe_audit.adapter``);
- :func:`check`: audits a router object of this process (no subprocess to re-import torch);
- ``moe_audit.routes``: routing records of a Hugging Face model, and :func:`moe_audit.routes.compare`
  (rollout against trainer in this process, the native extension ``moe_audit._native``);
- ``moe_audit.hf``: a Hugging Face ``transformers`` MoE block or router in one call
  (``moe_audit.hf.run(block)``; needs torch and transformers);
- ``moe_audit.snapshot``: snapshot tests of a router's routing decisions, also as the pytest
  fixture ``moe_audit_snapshot`` (``moe_audit.pytest_plugin``, with ``--moe-audit-update``).

The wire codecs are private (``moe_audit._wire``); ``moe_audit.v1`` and ``moe_audit.v2`` remain
as deprecated aliases.
"""

from .adapter import PROTOCOL_V1, PROTOCOL_V2, Routes, answer_plan, read_safetensors, routes_from_arrays, run, serve
from .binary import binary
from .inprocess import check
from .routes import Comparison, RoutesError
from .snapshot import SnapshotError, assert_routing_snapshot, routing_snapshot

__all__ = [
    "PROTOCOL_V1",
    "PROTOCOL_V2",
    "Routes",
    "Comparison",
    "RoutesError",
    "SnapshotError",
    "answer_plan",
    "assert_routing_snapshot",
    "binary",
    "check",
    "read_safetensors",
    "routes_from_arrays",
    "routing_snapshot",
    "run",
    "serve",
]
