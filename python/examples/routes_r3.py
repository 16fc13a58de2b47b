"""Engine against trainer routing on a Qwen3-MoE-style model (random init), as in the R3 paper.

Records one model three ways with ``moe_audit.routes.record`` and compares each engine-style
recording with the trainer's using ``moe-audit routes compare``:

- trainer: fp32, training mode, one forward over the whole sequences;
- engine fp32: eval mode, the prompt prefilled, every later token decoded through the KV cache;
- engine bf16: the same in bfloat16.

    python3 python/examples/routes_r3.py OUT_DIR [--chart docs/routes/bf16-layers.svg]

writes the recordings, ``config.json`` and one JSON report per setting to OUT_DIR and prints
the headline numbers beside the paper's (Ma et al. 2025: ~10% of decisions, 94% of tokens).
Seeded: the same command writes the same numbers.
"""

import copy
import json
import os
import subprocess
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moe_audit.routes as routes
from moe_audit import binary

BATCH, SEQ, PROMPT = 4, 256, 32


def main(out, chart=None):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=64, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(config)
    config.to_json_file(os.path.join(out, "config.json"))
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = lambda name: os.path.join(out, name)  # noqa: E731
    routes.record(model, ids, path("trainer.safetensors"), mode="train")
    routes.record(model, ids, path("engine-fp32.safetensors"), mode="eval", generate=True, prefill=PROMPT)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    routes.record(bf16, ids, path("engine-bf16.safetensors"), mode="eval", generate=True, prefill=PROMPT)
    print(f"{'setting':<34} {'decisions differ':>17} {'tokens differ':>14}")
    for name in ("engine-fp32", "engine-bf16"):
        args = [binary(), "routes", "compare", path(f"{name}.safetensors"), path("trainer.safetensors"),
                "--config", path("config.json"), "--format", "json"]
        if chart and name == "engine-bf16":
            args += ["--chart", chart]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1):
            sys.exit(done.stderr)
        with open(path(f"{name}.json"), "w") as f:
            f.write(done.stdout)
        m = json.loads(done.stdout)["measures"]
        print(f"{name + ' decode vs fp32 forward':<34} {100 * m['decisions_differ']:>16.2f}% "
              f"{100 * m['tokens_differ']:>13.2f}%")
    print(f"{'R3 paper (Qwen3-30B-A3B)':<34} {'~10%':>17} {'94%':>14}")


if __name__ == "__main__":
    args = sys.argv[1:]
    chart = None
    if "--chart" in args:
        i = args.index("--chart")
        chart = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], chart)
