"""A running vLLM or SGLang server audited for routing that depends on what a request must not
see: ``moe_audit.engine.audit(url)`` runs ``moe-audit engine URL --format json`` and returns its
report, axis by axis (docs/ENGINES.md).

    from moe_audit import engine
    report = engine.audit("http://127.0.0.1:8000", must_hold=("repeat", "stale", "batch"))
    for axis in report.axes:
        print(axis.axis, axis.changed, "of", axis.decisions)
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .binary import binary
from .errors import MoeAuditError

#: The axes, in report order.
AXES = ("batch", "cache", "stale", "decode", "continuation", "against", "repeat")


class EngineError(MoeAuditError, RuntimeError):
    """The audit could not run: a bad server, setting or connection (the binary's exit 2)."""


@dataclass(frozen=True)
class Change:
    """One (position, layer) decision whose expert set changed."""

    probe: int
    position: int
    layer: int
    a: list[int]
    b: list[int]


@dataclass(frozen=True)
class Axis:
    """What one axis found."""

    axis: str
    pairs: int
    decisions: int
    changed: int
    one_slot: int
    changes: list[Change]
    diverged: list[tuple[int, int]]
    must_hold: bool

    @property
    def held(self) -> bool:
        """Whether every compared decision and token held."""
        return self.changed == 0 and not self.diverged


@dataclass(frozen=True)
class EngineReport:
    """The audit of a server: its axes, whether an axis that must hold changed, the JSON."""

    axes: list[Axis]
    failed: bool
    requests: int
    document: dict[str, Any]


def audit(
    url: str,
    *,
    against: str | None = None,
    engine: str | None = None,
    config: str | None = None,
    axes: Sequence[str] | None = None,
    must_hold: Sequence[str] = ("repeat", "stale"),
    seed: int = 0,
    prompts: int | None = None,
    prompt_len: tuple[int, int] | None = None,
    generate: int | None = None,
    mates: int | None = None,
    vocab: int | None = None,
    cache_len: int | None = None,
    extension: int | None = None,
    long_prompts: int | None = None,
    long_len: int | None = None,
    concurrency: int | None = None,
    timeout: float | None = None,
    witness_dir: str | None = None,
) -> EngineReport:
    """Audits the server at ``url`` (``moe-audit engine``; ``None`` keeps the binary's default).
    Raises :class:`EngineError` with the binary's one-line message when nothing was judged."""
    args = ["engine", url, "--format", "json", "--seed", str(seed), "--must-hold", ",".join(must_hold)]
    for flag, value in (
        ("--against", against),
        ("--engine", engine),
        ("--config", config),
        ("--prompts", prompts),
        ("--generate", generate),
        ("--mates", mates),
        ("--vocab", vocab),
        ("--cache-len", cache_len),
        ("--extension", extension),
        ("--long-prompts", long_prompts),
        ("--long-len", long_len),
        ("--concurrency", concurrency),
        ("--timeout", timeout),
        ("--witness-dir", witness_dir),
    ):
        if value is not None:
            args += [flag, str(value)]
    if axes is not None:
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise EngineError(f"axes: {', '.join(unknown)} not among {', '.join(AXES)}")
        args += ["--axes", ",".join(axes)]
    if prompt_len is not None:
        args += ["--prompt-len", f"{prompt_len[0]}..{prompt_len[1]}"]
    done = subprocess.run([binary(), *args], capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise EngineError(done.stderr.strip() or f"moe-audit engine exited {done.returncode}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return EngineReport(
        axes=[
            Axis(
                axis=a["axis"],
                pairs=a["pairs"],
                decisions=a["decisions"],
                changed=a["changed"],
                one_slot=a["one_slot"],
                changes=[Change(**c) for c in a["changes"]],
                diverged=[(d["probe"], d["position"]) for d in a["diverged"]],
                must_hold=a["must_hold"],
            )
            for a in doc["axes"]
        ],
        failed=doc["failed"],
        requests=doc["requests"],
        document=doc,
    )
