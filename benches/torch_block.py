#!/usr/bin/env python3
"""The PyTorch references of BENCHMARKS.md's layer table: Hugging Face transformers' own
`MixtralSparseMoeBlock` (eager experts: one-hot mask, per hit expert `linear` → SwiGLU →
`linear` → scale → `index_add_`) and a dense SwiGLU FFN of size k × FFN (the same active
FLOPs), f32 on the CPU, `torch.set_num_threads(2)` unless told otherwise.

Shapes are the Rust benchmark's (`benches/common/layer_case.rs`): T = 2048 tokens, H 512, expert
FFN 1024, top-2, E 8 and 64. Weights are uniform in ±1/sqrt(fan_in) (the Rust side's seeded
init, drawn here by torch's generator from a fixed seed) and the input standard normal, so both
sides route a balanced load.

    python3 benches/torch_block.py [--reps 7] [--experts 8 64] [--threads 2]

prints each case's median time over rotating repetitions. With `--serve` it answers the Rust
benchmark (`cargo run --release --example layer_cost -- --torch`), which runs it as a child
process and asks for one timed forward at a time, so that both sides are measured in one run,
in rotating order: it reads lines `setup E` (answered `ready`) and `run moe` / `run dense`
(answered with the forward's seconds).
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

TOKENS, HIDDEN, FFN, TOP_K = 2048, 512, 1024, 2


def uniform_(t, fan_in):
    bound = 1.0 / fan_in**0.5
    return t.uniform_(-bound, bound)


class Case:
    """One expert count: the Mixtral block, the dense FFN, and the shared input."""

    def __init__(self, experts, seed=0):
        gen = torch.manual_seed(seed)
        config = MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_local_experts=experts,
            num_experts_per_tok=TOP_K,
            hidden_act="silu",
        )
        config._experts_implementation = "eager"  # the block's own loop over hit experts
        self.block = MixtralSparseMoeBlock(config).eval()
        with torch.no_grad():
            uniform_(self.block.gate.weight, HIDDEN)
            uniform_(self.block.experts.gate_up_proj, HIDDEN)
            uniform_(self.block.experts.down_proj, FFN)
            self.w13 = uniform_(torch.empty(2 * TOP_K * FFN, HIDDEN), HIDDEN)
            self.w2 = uniform_(torch.empty(HIDDEN, TOP_K * FFN), TOP_K * FFN)
        self.x = torch.randn(1, TOKENS, HIDDEN, generator=gen)

    @torch.inference_mode()
    def moe(self):
        return self.block(self.x)

    @torch.inference_mode()
    def dense(self):
        gate, up = F.linear(self.x, self.w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2)

    def timed(self, which):
        run = self.moe if which == "moe" else self.dense
        start = time.perf_counter()
        run()
        return time.perf_counter() - start


def serve():
    case = None
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["setup"]:
            case = Case(int(words[1]))
            for which in ("moe", "dense", "moe", "dense"):
                case.timed(which)
            print("ready", flush=True)
        elif words[:1] == ["run"] and case is not None and words[1] in ("moe", "dense"):
            print(f"{case.timed(words[1]):.9f}", flush=True)
        else:
            print(f"error: cannot read request {line.strip()!r}", flush=True)
            return 2
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve", action="store_true", help="answer the Rust benchmark on stdin/stdout")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        return serve()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, T={TOKENS} H={HIDDEN} FFN={FFN} k={TOP_K}")
    for experts in args.experts:
        case = Case(experts)
        samples = {"moe": [], "dense": []}
        for rep in range(2 + args.reps):
            for which in (("moe", "dense") if rep % 2 == 0 else ("dense", "moe")):
                t = case.timed(which)
                if rep >= 2:
                    samples[which].append(t)
        moe, dense = (statistics.median(samples[w]) * 1e3 for w in ("moe", "dense"))
        flops = 2 * TOKENS * HIDDEN * 3 * TOP_K * FFN
        print(f"E={experts:<2} torch moe {moe:7.2f} ms | torch dense {dense:7.2f} ms ({flops / dense / 1e6:.0f} GFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
