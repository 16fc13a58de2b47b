"""Times one audit of a Hugging Face router at hidden size 4096 (default audit sizes: batch 4,
seq_len 128, 32 trials, every probe), end to end, over moe-audit/1 (JSON lines) and moe-audit/2
(binary frames) side by side, plus the import overhead. BENCHMARKS.md has the numbers.

    python3 python/bench/hf_audit_time.py            # the table (needs torch and transformers)
    python3 python/bench/hf_audit_time.py --serve 2  # the router alone, for --router-cmd

Each audit runs `moe-audit check --router-cmd "python3 hf_audit_time.py --serve N"` as a user
would: Python starts, imports torch and transformers, builds the block, then answers.
"""

import os
import subprocess
import sys
import time

HIDDEN, EXPERTS, TOP_K = 4096, 8, 2


def block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    # The experts never run (moe_audit.hf stops at the router): keep them small.
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=64, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K)
    return MixtralSparseMoeBlock(config)


def timed(command):
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - start, proc


def main():
    import moe_audit

    python = sys.executable
    here = os.path.abspath(__file__)
    imports = {}
    for what in ("numpy", "moe_audit", "torch", "moe_audit.hf, transformers Mixtral"):
        mixtral = "moe_audit.hf; import transformers.models.mixtral.modeling_mixtral"
        module = {"moe_audit.hf, transformers Mixtral": mixtral}.get(what, what)
        seconds, proc = timed([python, "-c", f"import {module}"])
        imports[what] = seconds
    print(f"python {sys.version.split()[0]}, moe-audit {moe_audit.binary()}")
    for what, seconds in imports.items():
        print(f"import {what:40s} {seconds:6.2f} s (a fresh interpreter)")
    for protocol in (1, 2):
        seconds, proc = timed([moe_audit.binary(), "check", "--router-cmd", f"{python} {here} --serve {protocol}"])
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()
        print(f"moe-audit/{protocol}: one audit, hidden {HIDDEN}, end to end {seconds:7.1f} s "
              f"(exit {proc.returncode}: {last})")
    # The same audit from this process (moe_audit.check): no interpreter start, no imports.
    import moe_audit.hf

    router = moe_audit.hf.wrap(block(), protocol=2)
    start = time.perf_counter()
    report = moe_audit.check(router)
    seconds = time.perf_counter() - start
    leaks = ", ".join(report.leaks) or "none"
    print(f"moe-audit/2: the same audit in-process (moe_audit.check) {seconds:7.1f} s "
          f"(exit {report.exit_code}: leaks {leaks})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        import moe_audit.hf

        moe_audit.hf.run(block(), protocol=int(sys.argv[2]), argv=[])
    else:
        main()
