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
  fixture ``moe_audit_snapshot`` (``moe_audit.pytest_plugin``, with ``--moe-audit-update``).

The wire codecs are private (``moe_audit._wire``); ``moe_audit.v1`` and ``moe_audit.v2`` remain
as deprecated aliases.
"""

import importlib

# Eager (no numpy): importing the submodule `binary` would otherwise leave the module, not the
# function, as this attribute.
from .binary import binary as binary

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

__all__ = sorted([*_WHERE, "binary"])


def __getattr__(name):
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


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
