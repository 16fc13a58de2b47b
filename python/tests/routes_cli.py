"""`moe-audit routes compare ... --format json` as the tests run it: the exit code and the report."""

import json
import subprocess
from typing import Any

from moe_audit import binary


def routes_compare(a: Any, b: Any, *extra: str) -> tuple[int, Any]:
    out = subprocess.run(
        [binary(), "routes", "compare", str(a), str(b), "--format", "json", *extra],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)
