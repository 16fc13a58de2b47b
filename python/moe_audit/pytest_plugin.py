"""The pytest plugin of moe_audit (entry point ``pytest11``): the ``moe_audit_snapshot`` fixture
and the ``--moe-audit-update`` option (see :mod:`moe_audit.snapshot`)."""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import pytest

from .snapshot import UPDATE_MODES, assert_routing_snapshot


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moe-audit", "moe-audit routing snapshots")
    group.addoption(
        "--moe-audit-update",
        nargs="?",
        const="always",
        default=None,
        choices=UPDATE_MODES,
        metavar="MODE",
        help="rewrite the routing snapshots the tests touch (MODE always, the default), write "
        "changed ones as FILE.new and fail (new), or never write (no); wins over MOE_AUDIT_UPDATE "
        "and INSTA_UPDATE",
    )


def default_path(request: pytest.FixtureRequest) -> str:
    """``snapshots/TEST.snap`` beside the test file (a parametrised test's id made a file name)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")
    return os.path.join(os.path.dirname(str(request.path)), "snapshots", f"{name}.snap")


@pytest.fixture
def moe_audit_snapshot(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``moe_audit_snapshot(router, path=None, **options)``: asserts the router's routing
    snapshot (:func:`moe_audit.snapshot.assert_routing_snapshot`), at ``snapshots/TEST.snap``
    beside the test file when no path is given, updated as ``--moe-audit-update`` says."""
    update: str | None = request.config.getoption("moe_audit_update")

    def check(router: Any, path: str | os.PathLike[str] | None = None, **options: Any) -> None:
        assert_routing_snapshot(router, default_path(request) if path is None else path, update=update, **options)

    return check
