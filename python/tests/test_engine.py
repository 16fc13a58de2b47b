"""``moe_audit.engine.audit`` against the fake engine (tests/it/engines/fake_engine.py): the report
as dataclasses, the exit code as ``failed``, a bad server as :class:`EngineError`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moe_audit import MoeAuditError, engine

FAKE = Path(__file__).resolve().parents[2] / "tests" / "it" / "engines" / "fake_engine.py"
SMALL = {"prompts": 3, "mates": 3, "generate": 4, "prompt_len": (20, 40)}


@contextmanager
def fake(*args: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", "0", *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        yield f"http://127.0.0.1:{line.split()[1]}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_clean_engine_holds_and_a_decode_defect_is_found() -> None:
    with fake("--engine", "vllm") as url:
        report = engine.audit(url, **SMALL)  # type: ignore[arg-type]
        assert not report.failed
        assert [a.axis for a in report.axes] == ["batch", "cache", "stale", "decode", "continuation", "repeat"]
        assert all(a.held and a.decisions > 0 for a in report.axes)
        assert report.requests == 33
    with fake("--engine", "vllm", "--fault", "decode") as url:
        report = engine.audit(url, must_hold=("decode",), **{**SMALL, "prompts": 6})  # type: ignore[arg-type]
        assert report.failed
        decode = next(a for a in report.axes if a.axis == "decode")
        assert decode.changed > 0 and decode.must_hold
        assert all(c.position >= 20 for c in decode.changes)  # generated positions only


def test_a_bad_server_or_setting_is_an_engine_error() -> None:
    with fake("--engine", "vllm", "--no-routes") as url:
        with pytest.raises(MoeAuditError, match="--enable-return-routed-experts"):
            engine.audit(url, **SMALL)  # type: ignore[arg-type]
    with pytest.raises(engine.EngineError, match="not among"):
        engine.audit("http://127.0.0.1:1", axes=("bogus",))


def test_every_flag_the_wrapper_passes_is_the_binarys() -> None:
    """The keywords of :func:`moe_audit.engine.audit` become these flags: each must exist."""
    import inspect
    import subprocess as sp

    from moe_audit import binary

    help_text = sp.run([binary(), "engine", "--help"], capture_output=True, text=True, check=True).stdout
    keywords = [k for k in inspect.signature(engine.audit).parameters if k != "url"]
    for keyword in keywords:
        assert f"--{keyword.replace('_', '-')} " in help_text, keyword
