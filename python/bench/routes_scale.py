"""Routing-record comparison at scale (issue #36): time and peak memory of
`moe-audit routes compare` and of `moe_audit.routes.compare` in process, on uint8 `.npy` pairs of
T tokens x 60 layers x top-8 (256 experts, 1% of decisions flipped), as one RL step writes them.

    python3 python/bench/routes_scale.py --bin target/release/moe-audit [--python venv/bin/python]
        [--tokens 32768,262144,1048576] [--runs 3] [--dir /tmp/routes-scale]

Peak memory is the child's VmHWM (its resident high-water mark, mapped file pages included),
read from /proc while it runs (Linux). Records are written once (seeded) and reused.
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

LAYERS, TOP_K, EXPERTS = 60, 8, 256


def records(d, tokens):
    a, b = os.path.join(d, f"rollout-{tokens}.npy"), os.path.join(d, f"trainer-{tokens}.npy")
    if not (os.path.exists(a) and os.path.exists(b)):
        rng = np.random.default_rng(0)
        base = rng.integers(0, EXPERTS, size=(tokens, LAYERS, 1), dtype=np.int64)
        # Distinct ids per row: base + 31·i (mod 256) for i < 8.
        ids = ((base + np.arange(TOP_K) * 31) % EXPERTS).astype(np.uint8)
        np.save(a, ids)
        flip = rng.random((tokens, LAYERS)) < 0.01
        last = ids[..., TOP_K - 1].astype(np.int64)
        ids[..., TOP_K - 1] = np.where(flip, (last + 128) % EXPERTS, last).astype(np.uint8)
        np.save(b, ids)
    return a, b


def measure(cmd):
    """Wall seconds and peak resident MiB of `cmd` (polled every 20 ms from /proc)."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    peak = 0
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - start
    if p.returncode not in (0, 1):
        sys.exit(f"{cmd}: exit {p.returncode}")
    return wall, peak / 1024


IN_PROCESS = """
import sys, time, numpy as np, moe_audit.routes as routes
a, b = (np.load(p, mmap_mode="r") for p in sys.argv[1:3])
routes.compare(a[:64], b[:64])  # the extension loaded
t = time.perf_counter()
c = routes.compare(a, b)
print(time.perf_counter() - t, c.measures["decisions_differ"])
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--python")
    ap.add_argument("--tokens", default="32768,262144,1048576")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/routes-scale")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print("| tokens | record MiB | run | wall s | peak MiB |")
    print("|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        a, b = records(args.dir, tokens)
        mib = os.path.getsize(a) / 2**20
        runs = [("CLI", [args.bin, "routes", "compare", a, b, "--format", "json"])]
        if args.python:
            runs.append(("in process", [args.python, "-c", IN_PROCESS, a, b]))
        for name, cmd in runs:
            for _ in range(args.runs):
                wall, peak = measure(cmd)
                print(f"| {tokens:,} | {mib:.0f} | {name} | {wall:.2f} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
