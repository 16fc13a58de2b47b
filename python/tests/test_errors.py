"""One exception base: every exception class the package defines derives from
``moe_audit.MoeAuditError``, and keeps the builtin base its callers caught before."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import moe_audit

# The builtin base each kept: an `except ValueError` written before MoeAuditError still works.
BUILTIN = {"CheckError": ValueError, "RoutesError": ValueError, "SnapshotError": RuntimeError,
           "NotCovered": TypeError, "NotKeyed": RuntimeError, "EngineError": RuntimeError}


def defined_exceptions() -> dict[str, type[BaseException]]:
    """Every public exception class defined in a module of the package (all of them imported:
    under CI every optional framework is installed)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(moe_audit.__path__, "moe_audit."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name
                    and not name.startswith("_")):
                found[f"{info.name}.{name}"] = value
    return found


def test_every_public_exception_class_derives_from_moe_audit_error():
    found = defined_exceptions()
    assert sorted(c.__name__ for c in found.values()) == sorted([*BUILTIN, "MoeAuditError"])
    for where, cls in found.items():
        assert issubclass(cls, moe_audit.MoeAuditError), where
        assert cls is moe_audit.MoeAuditError or issubclass(cls, BUILTIN[cls.__name__]), where


def test_moe_audit_error_is_exported_and_catches_an_error_of_the_package():
    assert "MoeAuditError" in moe_audit.__all__
    with pytest.raises(moe_audit.MoeAuditError, match="--batch") as caught:
        moe_audit.check(lambda data, mode: [], batch=0, experts=4, top_k=1)
    assert isinstance(caught.value, moe_audit.CheckError) and isinstance(caught.value, ValueError)
