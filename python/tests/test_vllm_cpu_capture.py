"""The vLLM plugin's opt-in and its one-line refusals (moe_audit.vllm_cpu_capture), each in a fresh
interpreter whose ``vllm`` is a stand-in package: vLLM loads the entry point in every process of
every server, with or without moe-audit's variable, so unset it must not even import vllm, and set
where it cannot apply it must say why in one line and patch nothing. That it applies, against the
real vllm-cpu 0.28.0, is the engine benchmark's (docs/engines/vllm-0.28-cpu.md, python/bench/engine_setup.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = "MOE_AUDIT_VLLM_CPU_CAPTURE"


def run_register(tmp_path: Path, vllm_init: str, value: str | None) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text(vllm_init)
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "python")])
    if value is not None:
        env[ENV] = value
    code = "import sys; from moe_audit.vllm_cpu_capture import register; register(); print('vllm' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("value", [None, "", "0"])
def test_off_unless_set_imports_nothing(tmp_path: Path, value: str | None) -> None:
    proc = run_register(tmp_path, "raise RuntimeError('imported')\n", value)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "False\n", "")


def test_another_release_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_register(tmp_path, "__version__ = '0.99.0'\n", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "moe-audit vllm plugin: cannot apply (vllm 0.99.0, read for 0.28.0); nothing patched\n"


def test_vllm_that_does_not_import_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_register(tmp_path, "raise ImportError('no torch')\n", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "moe-audit vllm plugin: cannot apply (vllm does not import: no torch); nothing patched\n"


def test_a_value_other_than_0_or_1_is_named(tmp_path: Path) -> None:
    proc = run_register(tmp_path, "raise RuntimeError('imported')\n", "yes")
    assert (proc.returncode, proc.stdout) == (0, "False\n")
    assert proc.stderr == f"moe-audit vllm plugin: {ENV}='yes' is not 1 or 0; nothing patched\n"


def test_installed_entry_point_is_register() -> None:
    """As vLLM finds it (vllm 0.28.0 ``plugins/__init__.py:38-42``): the installed package's entry point."""
    from moe_audit.vllm_cpu_capture import register

    found = {e.name: e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("moe_audit")}
    assert list(found) == ["moe_audit_vllm_cpu_capture"], "moe-audit is not installed (pip install .)"
    assert found["moe_audit_vllm_cpu_capture"].load() is register
