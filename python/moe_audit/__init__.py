"""moe_audit: audit Mixture-of-Experts routers written in Python with the moe-audit binary.

``pip install moe-audit`` installs the ``moe-audit`` binary and this package:

- the protocol adapter: :func:`run` serves ``route(data, mode)`` to ``moe-audit check
  --router-cmd``; :func:`routes_from_arrays` builds its answer; :func:`answer_plan` answers trace
  files (``moe_audit.adapter``);
- :func:`check`: audits a router object of this process (no subprocess to re-import torch) and
  returns its :class:`Report` (verdicts per probe, leaks, exit code, the JSON document);
- ``moe_audit.routes``: routing records of a Hugging Face model, and :func:`moe_audit.routes.compare`
  (rollout against trainer in this process, the native extension ``moe_audit._native``);
- ``moe_audit.hf``: a Hugging Face ``transformers`` MoE block or router in one call
  (``moe_audit.hf.run(block)``; needs torch and transformers);
- ``moe_audit.snapshot``: snapshot tests of a router's routing decisions, also as the pytest
  fixture ``moe_audit_snapshot`` (``moe_audit.pytest_plugin``, with ``--moe-audit-update``);
- ``moe_audit.engine``: a running vLLM or SGLang server audited axis by axis
  (``moe_audit.engine.audit(url)``, the ``moe-audit engine`` command);
  ``moe_audit.vllm_cpu_capture``: the vLLM plugin that makes vLLM 0.28's CPU build return routes;
- :class:`MoeAuditError`: the base of every exception the package defines.

The wire codecs are private (``moe_audit._wire``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager (no numpy): importing the submodule `binary` would otherwise leave the module, not the
# function, as this attribute.
from .binary import binary as binary
from .errors import MoeAuditError as MoeAuditError

if TYPE_CHECKING:
    # What __getattr__ loads, as type checkers see it (`as`: re-exported).
    from .adapter import PROTOCOL_V1 as PROTOCOL_V1
    from .adapter import PROTOCOL_V2 as PROTOCOL_V2
    from .adapter import Routes as Routes
    from .adapter import answer_plan as answer_plan
    from .adapter import read_safetensors as read_safetensors
    from .adapter import routes_from_arrays as routes_from_arrays
    from .adapter import run as run
    from .adapter import serve as serve
    from .inprocess import CheckError as CheckError
    from .inprocess import Report as Report
    from .inprocess import check as check
    from .routes import Comparison as Comparison
    from .routes import RoutesError as RoutesError
    from .snapshot import SnapshotError as SnapshotError
    from .snapshot import assert_routing_snapshot as assert_routing_snapshot
    from .snapshot import routing_snapshot as routing_snapshot

# Where each name is defined. Loaded on first use (PEP 562), so that importing a submodule
# alone loads nothing else: the `moe-audit` console script (moe_audit._native) starts without
# numpy, whose threads would otherwise receive the SIGINT the command's signal thread waits for.
_WHERE = {
    "PROTOCOL_V1": "adapter",
    "PROTOCOL_V2": "adapter",
    "Routes": "adapter",
    "answer_plan": "adapter",
    "read_safetensors": "adapter",
    "routes_from_arrays": "adapter",
    "run": "adapter",
    "serve": "adapter",
    "CheckError": "inprocess",
    "Report": "inprocess",
    "check": "inprocess",
    "Comparison": "routes",
    "RoutesError": "routes",
    "SnapshotError": "snapshot",
    "assert_routing_snapshot": "snapshot",
    "routing_snapshot": "snapshot",
}

__all__ = sorted([*_WHERE, "MoeAuditError", "binary"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    # Submodules as attributes (`moe_audit.routes`), as when this file imported them.
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
