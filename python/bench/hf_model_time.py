"""Time of a whole-model audit (issue #27): a 4-layer Qwen3-MoE-style model (hidden 128, 64
experts, top 8, random init, seed 0), ``moe-audit model --cmd`` at the default sizes, end
to end as a user runs it (a fresh interpreter: torch and transformers imported, the model built,
every call answered), then the same audit in-process (``moe_audit.check``, torch imported).

    MOE_AUDIT_BIN=target/debug/moe-audit PYTHONPATH=python python3 python/bench/hf_model_time.py
"""

import os
import subprocess
import sys
import tempfile
import time

MODEL = """
import torch, transformers
transformers.logging.set_verbosity_error()
# The README's model.
config = transformers.Qwen3MoeConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64, vocab_size=1000)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config)
"""


def main():
    from moe_audit import binary

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["python", os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "serve.py")
        with open(script, "w") as f:
            f.write(MODEL + "import moe_audit.hf\nmoe_audit.hf.run(model)\n")
        start = time.perf_counter()
        proc = subprocess.run([binary(), "model", "--cmd", f"{sys.executable} {script}", "--timeout", "600"],
                              capture_output=True, text=True, env=env)
        took = time.perf_counter() - start
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"model --cmd, end to end (imports included)   {took:6.1f} s (exit {proc.returncode}: {last})")
    if proc.returncode == 2:
        print(proc.stderr, file=sys.stderr)
    scope = {}
    exec(MODEL, scope)
    import moe_audit
    import moe_audit.hf

    start = time.perf_counter()
    report = moe_audit.check(moe_audit.hf.wrap(scope["model"]))
    took = time.perf_counter() - start
    leaks = ", ".join(report.leaks) or "none"
    print(f"the same audit in-process (moe_audit.check)  {took:6.1f} s (exit {report.exit_code}: leaks {leaks})")
    print(" ".join(f"{p} {v}" for p, v in report.verdicts.items()))


if __name__ == "__main__":
    main()
