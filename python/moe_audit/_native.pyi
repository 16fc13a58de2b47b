"""Types of the native extension ``moe_audit._native`` (crates/moe-audit-py/src/lib.rs)."""

# One array: (address, bytes, numpy dtype name, (tokens, layers, top_k)).
RawPart = tuple[int, int, str, tuple[int, int, int]]
# A record file's path, or (name, one array per sequence, global layer numbers or None).
Side = str | tuple[str, list[RawPart], list[int] | None]

def compare(
    rollout: Side,
    trainer: Side,
    config: str | None = None,
    config_json: str | None = None,
    max_disagreement: float | None = None,
    max_memory: str | None = None,
) -> tuple[bool, str]:
    """``routes compare`` in this process: ``(True, json)``, or ``(False, one-line message)``."""

def main() -> None:
    """The ``moe-audit`` command on ``sys.argv``; exits the process with its code."""
