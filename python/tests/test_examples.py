"""The examples in python/examples, run as their docstrings tell a user to run them: the command a
docstring shows, by a shell, with this environment's `python3` and `moe-audit` first on the PATH
(as an activated environment where `pip install moe-audit` ran puts them), from the checkout's
root (or, for the recipe meant to be copied next to the model code, from its own folder). Each
exits as its `# exit N` comment says, and leaks exactly on the probes the comment names, in the
verdict lines it prints; routes_r3.py prints the figures docs/ROUTES.md quotes.

Needs numpy (every example), torch and transformers (torch_router.py, hf_router.py,
routes_r3.py), torch and torchtitan (ep_torchtitan.py): without them a test is skipped with the
reason (under CI it fails: conftest.py).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import moe_audit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "python" / "examples"
PROBES = "PFNRDSML"
# An indented docstring line: `moe-audit ...   # exit N` or `# exit 1: P F N R L leak`.
CLAIM = re.compile(r"^\s+(moe-audit .+?)\s+# exit (\d+)(?::\s*([A-Z ]+?) leak)?\s*$", re.M)
# What each example needs beyond numpy.
NEEDS = {"torch_router.py": ["torch"], "hf_router.py": ["torch", "transformers"],
         "routes_r3.py": ["torch", "transformers"], "ep_torchtitan.py": ["torch", "torchtitan"],
         "ep_megatron.py": ["torch", "megatron.core"], "ep_megatron_gpt.py": ["torch", "megatron.core"],
         "ep_deepspeed.py": ["torch", "deepspeed"]}


def docstring(name):
    return Path(EXAMPLES / name).read_text().split('"""')[1]


def claims():
    """(example, command, exit code, leaking probes) of every example's documented `moe-audit` line."""
    found = []
    for path in sorted(EXAMPLES.glob("*.py")):
        for command, code, leaking in CLAIM.findall(docstring(path.name)):
            found.append((path.name, command, int(code), "".join(leaking.split())))
    return found


def environment():
    """The binary's folder and this interpreter's first on the PATH (in CI's environment one folder:
    the wheel's moe-audit beside its python3; from a checkout, MOE_AUDIT_BIN's), no bytecode
    written into the checkout."""
    path = [os.path.dirname(moe_audit.binary()), os.path.dirname(sys.executable), os.environ["PATH"]]
    return dict(os.environ, PATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")


def shell(command, cwd, timeout):
    return subprocess.run(["sh", "-c", command], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout)


MODEL_PROBES = "PFNRDSMG"


def printed_verdicts(stdout):
    """{probe: verdict} of the verdict lines of `moe-audit check` (router, probe letter and name,
    verdict, ...) or `moe-audit model` (probe letter and name, property, verdict, ...)."""
    found = {}
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and len(fields[1]) == 1 and fields[1] in PROBES:
            found[fields[1]] = fields[3]
        elif (len(fields) >= 4 and len(fields[0]) == 1 and fields[0] in MODEL_PROBES
              and fields[1].replace("-", "").isalpha()):
            found.setdefault(fields[0], fields[3])  # the table's line, not the details under it
    return found


def test_every_example_is_run_here():
    # A new example states how to run it and what it gives, or is added to this module.
    documented = {name for name, *_ in claims()} | {"routes_r3.py"}
    assert documented == {p.name for p in EXAMPLES.glob("*.py")}


@pytest.mark.parametrize("name,command,code,leaking", claims(), ids=[c[0] for c in claims()])
def test_the_example_gives_the_verdicts_its_docstring_states(name, command, code, leaking):
    for module in NEEDS.get(name, []):
        pytest.importorskip(module, reason=f"{name} needs {module}, which is not installed")
    # Run from the checkout's root when the command names the example's path; the recipe meant to
    # be copied (`python3 torch_router.py`) runs beside it.
    assert name in command
    cwd = REPO if "python/examples/" in command else EXAMPLES
    done = shell(command, cwd, timeout=600)
    assert done.returncode == code, done.stdout + done.stderr
    verdicts = printed_verdicts(done.stdout)
    # A whole model has no L; its G is n/a unless the model runs the generation path.
    probes = MODEL_PROBES if command.startswith("moe-audit model") else PROBES
    assert sorted(verdicts) == sorted(probes), done.stdout
    assert "".join(p for p in probes if verdicts[p] == "LEAK") == leaking, done.stdout
    assert all(v in ("pass", "LEAK") or (p == "G" and v == "n/a") for p, v in verdicts.items()), done.stdout


def documented_figures():
    """{setting: (decisions differ, tokens differ)} of docs/ROUTES.md's table of routes_r3.py."""
    text = (REPO / "docs" / "ROUTES.md").read_text()
    rows = re.findall(r"^\| (fp32|bf16), KV-cache decode \| ([\d.]+)% \| ([\d.]+)% \|$", text, re.M)
    assert len(rows) == 2, "docs/ROUTES.md's table of routes_r3.py"
    return {f"engine-{setting}": (decisions, tokens) for setting, decisions, tokens in rows}


def test_routes_r3_prints_the_figures_docs_routes_quotes(tmp_path):
    pytest.importorskip("torch", reason="routes_r3.py needs torch, which is not installed")
    pytest.importorskip("transformers", reason="routes_r3.py needs transformers, which is not installed")
    usage = re.search(r"^\s+(python3 python/examples/routes_r3.py OUT_DIR) \[--chart (\S+)\]$",
                      docstring("routes_r3.py"), re.M)
    assert usage, "routes_r3.py's docstring shows how to run it"
    chart = tmp_path / "bf16-layers.svg"
    command = usage.group(1).replace("OUT_DIR", shlex.quote(str(tmp_path / "out")))
    done = shell(f"{command} --chart {shlex.quote(str(chart))}", REPO, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = {m[0]: (m[1], m[2]) for m in
               re.findall(r"^(engine-\w+) decode vs fp32 forward\s+([\d.]+)%\s+([\d.]+)%$", done.stdout, re.M)}
    assert printed == documented_figures(), done.stdout
    # The chart docs/ROUTES.md shows is the one this run draws.
    assert chart.read_bytes() == (REPO / usage.group(2)).read_bytes()
