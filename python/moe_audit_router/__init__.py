"""Deprecated: the adapter moved to :mod:`moe_audit` (``from moe_audit import run``).

``moe_audit_router`` was the single-file adapter before the ``moe-audit`` package; adapters
written for it keep working through this alias, which speaks the ``moe-audit/1`` protocol it
spoke (the package defaults to ``moe-audit/2``) and warns once on import.
"""

import functools
import warnings

from moe_audit import adapter as _adapter
from moe_audit import v1 as _v1

warnings.warn(
    "moe_audit_router is deprecated: import from moe_audit instead "
    "(from moe_audit import run, serve, answer_plan, routes_from_arrays, read_safetensors)",
    DeprecationWarning,
    stacklevel=2,
)

PROTOCOL = _v1.PROTOCOL

routes_from_arrays = _adapter.routes_from_arrays
read_safetensors = _adapter.read_safetensors
serve = functools.partial(_adapter.serve, protocol=PROTOCOL)
answer_plan = functools.partial(_adapter.answer_plan, protocol=PROTOCOL)
run = functools.partial(_adapter.run, protocol=PROTOCOL)

__all__ = ["PROTOCOL", "answer_plan", "read_safetensors", "routes_from_arrays", "run", "serve"]
