"""Snapshot tests of a Python router's routing decisions, one line in a pytest test::

    from moe_audit.snapshot import assert_routing_snapshot

    def test_router_routing():
        assert_routing_snapshot(route, "tests/snapshots/router.snap", experts=8, top_k=2)

``route(data, mode)`` is the function the adapter serves (``moe_audit.run``): ``data`` is
float32 ``[batch, seq_len, width]``, ``mode`` is ``"train"`` or ``"inference"``; it returns the
tokens' routes (``routes_from_arrays``) and the capacity or None. An object with a ``route``
method and ``name``, ``experts``, ``top_k``, ``input``, ``hidden_size`` attributes works too.

The ``moe-audit`` binary does everything but the routing, so the file has the same bytes as
``moe-audit snapshot`` and ``moe_audit::snapshot`` for the same routing: it writes the inputs
(``moe-audit snapshot plan DIR``: seeded rows, or ``logits=``/``hidden_states=`` files), the
router answers them here, in-process, in training and inference mode, and the binary renders and
compares (``moe-audit snapshot check FILE --traces DIR``). A printed weight may move by one
unit of its 4th decimal (float noise) without failing; any other change fails with a diff naming
each token's change and how many tokens moved.

The binary is ``$MOE_AUDIT_BIN``, else the one ``pip install moe-audit`` put beside the
interpreter, else ``moe-audit`` on the PATH (``cargo install --path .``).

Under pytest the fixture ``moe_audit_snapshot`` does the same, with the snapshot at
``snapshots/TEST.snap`` beside the test file unless a path is given::

    def test_router_routing(moe_audit_snapshot):
        moe_audit_snapshot(route, experts=8, top_k=2)

(``moe_audit.pytest_plugin``: pytest loads it from the installed package; with the package only
on ``PYTHONPATH``, ``pytest -p moe_audit.pytest_plugin``.)

Updating, as insta and syrupy users expect:

- a missing snapshot is written, except when ``CI`` is set (then the test fails);
- ``pytest --moe-audit-update``, ``MOE_AUDIT_UPDATE=1`` or ``INSTA_UPDATE=always`` rewrites every
  snapshot the tests touch;
- ``--moe-audit-update=new`` or ``INSTA_UPDATE=new`` writes a changed or missing snapshot beside
  it as ``FILE.new`` for review, and fails; ``--moe-audit-update=no`` or ``INSTA_UPDATE=no`` never
  writes. The option wins over the variables.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from .adapter import Router, answer_plan, describe
from .binary import binary
from .errors import MoeAuditError

#: The update modes: ``auto`` (write a missing snapshot unless ``CI`` is set), ``always``,
#: ``new`` (write ``FILE.new`` and fail) and ``no``.
UPDATE_MODES = ("auto", "always", "new", "no")

# Seconds any one moe-audit call may take (it only writes inputs or renders and compares).
TIMEOUT = 300


class SnapshotError(MoeAuditError, RuntimeError):
    """moe-audit could not make or read a snapshot (a bad file, bad options, no binary)."""


def _moe_audit(*args: object, codes: Sequence[int] = (0,)) -> subprocess.CompletedProcess[str]:
    try:
        path = binary()
    except FileNotFoundError as e:
        raise SnapshotError(str(e)) from None
    try:
        proc = subprocess.run(
            [path, "snapshot", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        raise SnapshotError(f"moe-audit snapshot record took over {TIMEOUT} s: {e.cmd}") from None
    if proc.returncode not in codes:
        raise SnapshotError(proc.stderr.strip() or f"moe-audit exited with {proc.returncode}")
    return proc


def _plan(router: Router, directory: str, options: dict[str, Any]) -> None:
    """Writes the inputs into directory and answers them with the router; returns nothing."""
    options = dict(options)
    route, spec = describe(router, options)
    args = ["plan", directory, "--name", spec["name"], "--experts", spec["experts"],
            "--input", spec["input"]]
    if spec["top_k"] is not None:
        args += ["--top-k", spec["top_k"]]
    if spec["hidden_size"] is not None:
        args += ["--hidden", spec["hidden_size"]]
    flags = {"batch": "--batch", "seq_len": "--seq-len", "seed": "--seed", "logits": "--logits",
             "hidden_states": "--hidden-states"}
    for key, flag in flags.items():
        value = options.pop(key, None)
        if value is not None:
            args += [flag, os.fspath(value) if key in ("logits", "hidden_states") else value]
    if options:
        raise TypeError(f"unknown options: {', '.join(sorted(options))}")
    _moe_audit(*args)
    answer_plan(route, directory)


def routing_snapshot(router: Router, **options: Any) -> str:
    """The snapshot text of the router's routing (what assert_routing_snapshot stores).

    options: experts, top_k, name, input ("logits" or "hidden"), hidden_size (the router's
    description, keywords or router attributes); batch (2), seq_len (8), seed (0), logits or
    hidden_states (a JSON file of batch*seq_len rows; paths are recorded as given).
    """
    with tempfile.TemporaryDirectory(prefix="moe-audit-snapshot-") as directory:
        _plan(router, directory, options)
        return _moe_audit("record", "--traces", directory).stdout


def update_mode(option: str | None = None) -> str:
    """The update mode: ``option`` when given (``--moe-audit-update``), else from the variables."""
    if option is not None:
        if option not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {', '.join(UPDATE_MODES)}, got {option!r}")
        return option
    if os.environ.get("MOE_AUDIT_UPDATE", "") not in ("", "0"):
        return "always"
    insta = os.environ.get("INSTA_UPDATE", "auto")
    return {"1": "always", "always": "always", "new": "new", "no": "no", "0": "no"}.get(insta, "auto")


def assert_routing_snapshot(router: Router, path: str | os.PathLike[str], *, update: str | None = None,
                            **options: Any) -> None:
    """Fails (AssertionError with the diff) when the router's routing differs from the snapshot
    at path; writes it when missing or when updating (see the module docstring; ``update`` is an
    update mode that wins over the variables). Options as routing_snapshot."""
    path = os.fspath(path)
    mode = update_mode(update)
    exists = os.path.exists(path)
    with tempfile.TemporaryDirectory(prefix="moe-audit-snapshot-") as directory:
        _plan(router, directory, options)
        write = mode == "always" or (not exists and mode == "auto" and not os.environ.get("CI"))
        if write:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            _moe_audit("record", "--traces", directory, "--output", path)
            return
        if not exists:
            if mode == "new":
                _moe_audit("record", "--traces", directory, "--output", path + ".new")
            raise AssertionError(
                f"{path}: no snapshot; write it with MOE_AUDIT_UPDATE=1 (or INSTA_UPDATE=always, or pytest "
                "--moe-audit-update)"
            )
        proc = _moe_audit("check", path, "--traces", directory, codes=(0, 1))
        if proc.returncode == 1:
            hint = "rewrite it with MOE_AUDIT_UPDATE=1 (or INSTA_UPDATE=always, or pytest --moe-audit-update)"
            if mode == "new":
                _moe_audit("record", "--traces", directory, "--output", path + ".new")
                hint = f"the new snapshot is {path}.new"
            raise AssertionError(f"{proc.stdout}{hint}")
