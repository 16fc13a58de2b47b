"""Deprecated: the moe-audit/2 wire codec is private now, as ``moe_audit._wire.v2``. Pass
``protocol=2`` (or ``moe_audit.PROTOCOL_V2``) to the adapter instead of using it."""

import warnings

from ._wire.v2 import *  # noqa: F401,F403
from ._wire.v2 import PROTOCOL  # noqa: F401

warnings.warn(
    "moe_audit.v2 is deprecated: the wire codec is private (moe_audit._wire.v2); "
    "pass protocol=2 or moe_audit.PROTOCOL_V2 to the adapter",
    DeprecationWarning,
    stacklevel=2,
)
