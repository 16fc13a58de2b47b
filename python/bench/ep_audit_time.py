"""Times a layer audit at EP 2 as users launch it, for each framework's example
(python/examples/ep_*.py: hidden 64, 8 experts, top-2, default probes, batch 4 x seq_len 128), and
splits it: the launch (spawn to handshake, measured on its own launch), and rank 0's time while
serving as ``MOE_AUDIT_TIMINGS`` writes it (forwards, collectives, answering, waiting for
moe-audit). Medians of 3 runs. BENCHMARKS.md has the numbers.

    python3 python/bench/ep_audit_time.py   # needs torch, megatron-core, deepspeed, torchtitan
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import moe_audit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")


def launch_time(command):
    """Seconds from spawning the launch to its handshake line."""
    start = time.monotonic()
    proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=ENV, cwd=REPO, start_new_session=True)
    proc.stdout.readline()
    elapsed = time.monotonic() - start
    proc.stdin.close()
    proc.wait(timeout=120)
    return elapsed


def audit(command, timings):
    """(seconds, rank 0's timings) of one `moe-audit check` of the launch."""
    start = time.monotonic()
    subprocess.run([moe_audit.binary(), "check", "--router-cmd", command], capture_output=True, cwd=REPO,
                   env=dict(ENV, MOE_AUDIT_TIMINGS=timings), check=False)
    elapsed = time.monotonic() - start
    with open(timings) as f:
        return elapsed, json.load(f)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for framework in ("megatron", "deepspeed", "torchtitan"):
            command = (f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 "
                       f"python/examples/ep_{framework}.py")
            launches, walls, figures = [], [], []
            for _ in range(3):
                launches.append(launch_time(command))
                wall, timings = audit(command, os.path.join(tmp, "timings.json"))
                walls.append(wall)
                figures.append(timings)
            median = {k: statistics.median(t[k] for t in figures) for k in figures[0]}
            split = " / ".join(f"{median[f'{k}_s']:.2f}" for k in ("forwards", "collectives", "answering", "waiting"))
            print(f"{framework}: audit {statistics.median(walls):.1f} s, launch {statistics.median(launches):.1f} s, "
                  f"serving {median['serving_s']:.2f} s (forwards / collectives / answering / waiting: {split} s), "
                  f"{figures[0]['calls']} calls", flush=True)


if __name__ == "__main__":
    main()
