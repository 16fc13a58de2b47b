"""A DeepSpeed MoE layer audited as training runs it: expert-parallel over the ranks of a
``torch.distributed.run`` launch, each rank routing its own sequences (docs/DISTRIBUTED.md).

The script builds ``deepspeed.moe.layer.MoE`` as a model does and hands it to
``moe_audit.deepspeed.run``. DeepSpeed computes the capacity per rank over that rank's tokens
(deepspeed 0.19.8 ``moe/sharded_moe.py:152-162``, ``:364``) and drops by position; its default
top-2 samples the second expert with Gumbel noise even in ``eval()`` (``sharded_moe.py:338``,
``:579-582``): with ``--sampled`` the same call routes differently twice (D leaks) and every
other probe is inconclusive, its changes not told apart from the noise, until the draws are keyed
per token on the request's seed (``--seed-calls``)::

    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_deepspeed.py"   # exit 1: P F N R L leak
    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_deepspeed.py --sampled --seed-calls"   # exit 1: P F N R L leak

Options: ``--sampled`` (DeepSpeed's default top-2 sampling), ``--seed-calls`` (its draws keyed
per token on the request's seed: the same call draws the same noise), ``--dropless`` (``drop_tokens=False``),
``--placement contiguous|strided``, ``--capacity-factor F``. Needs torch and deepspeed
(``DS_BUILD_OPS=0 pip install deepspeed``).
"""

import argparse

# First: under the launcher it keeps stdout for the protocol, before anything can print there.
import moe_audit.deepspeed  # isort: split

import deepspeed
import torch
from deepspeed.moe.layer import MoE

parser = argparse.ArgumentParser()
parser.add_argument("--sampled", action="store_true")
parser.add_argument("--seed-calls", action="store_true")
parser.add_argument("--dropless", action="store_true")
parser.add_argument("--placement", default="contiguous", choices=["contiguous", "strided"])
parser.add_argument("--capacity-factor", type=float, default=1.0)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
ep = torch.distributed.get_world_size()
torch.manual_seed(0)
expert = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.GELU(), torch.nn.Linear(128, 64, bias=False))
moe = MoE(hidden_size=64, expert=expert, num_experts=8, ep_size=ep, k=2, capacity_factor=args.capacity_factor,
          eval_capacity_factor=args.capacity_factor, min_capacity=4, drop_tokens=not args.dropless,
          top2_2nd_expert_sampling=args.sampled)
moe.set_deepspeed_parallelism()  # what deepspeed.initialize() does for an MoE layer
moe_audit.deepspeed.seed_experts(moe, seed=0)  # distinct experts, the same at any EP size
moe_audit.deepspeed.run(moe, placement=args.placement, seed_calls=args.seed_calls)
