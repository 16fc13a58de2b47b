"""Where the moe-audit binary is."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig


def binary() -> str:
    """The moe-audit binary: ``$MOE_AUDIT_BIN``, else the one this package's wheel installed
    beside the interpreter's scripts, else ``moe-audit`` on the PATH. FileNotFoundError if none."""
    path = os.environ.get("MOE_AUDIT_BIN")
    if path:
        return path
    for where in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        found = shutil.which("moe-audit", path=where)
        if found:
            return found
    found = shutil.which("moe-audit")
    if not found:
        raise FileNotFoundError(
            "moe-audit not found: pip install moe-audit, or set MOE_AUDIT_BIN, or put it on the PATH"
        )
    return found
