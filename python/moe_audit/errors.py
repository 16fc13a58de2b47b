"""The package's one exception base: every exception ``moe_audit`` raises on purpose derives from
:class:`MoeAuditError`, beside the builtin its callers caught before (``ValueError``,
``RuntimeError``, ``TypeError``), so ``except moe_audit.MoeAuditError`` catches them all and an
older ``except ValueError`` still works. No imports: ``import moe_audit`` loads it eagerly.
"""

from __future__ import annotations


class MoeAuditError(Exception):
    """Base class of every exception this package defines (:class:`moe_audit.CheckError`,
    :class:`moe_audit.RoutesError`, :class:`moe_audit.SnapshotError`,
    ``moe_audit.hf.NotCovered``, ``moe_audit.hf.seeded.NotKeyed``)."""
