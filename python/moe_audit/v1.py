"""Deprecated: the moe-audit/1 wire codec is private now, as ``moe_audit._wire.v1``. Pass
``protocol=1`` (or ``moe_audit.PROTOCOL_V1``) to the adapter instead of using it."""

import warnings

from ._wire.v1 import *  # noqa: F401,F403
from ._wire.v1 import PROTOCOL  # noqa: F401

warnings.warn(
    "moe_audit.v1 is deprecated: the wire codec is private (moe_audit._wire.v1); "
    "pass protocol=1 or moe_audit.PROTOCOL_V1 to the adapter",
    DeprecationWarning,
    stacklevel=2,
)
