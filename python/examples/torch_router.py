"""Recipe: audit a PyTorch router module (Megatron-LM, DeepSpeed, Hugging Face) with moe-audit.

Copy this file next to your model code and adapt the three marked places. It needs torch (and
numpy); moe-audit talks to it over stdin/stdout (as it is, top-2 per token: no leak):

    moe-audit check --router-cmd "python3 torch_router.py"   # exit 0

1. Build the router exactly as training builds it (same config, same capacity factor, same drop
   policy) and load a checkpoint if the gate's weights matter (`input="hidden"`). For a router
   whose gate is a plain linear layer you may audit from logits instead (`input="logits"`,
   replace the gate by the identity): the probes then craft inputs in logit space.
2. `mode` is "train" or "inference": switch the module with `.train()` / `.eval()` so moe-audit's
   M probe compares what training and serving really do.
3. Turn the module's outputs into routes: for each token (sequence-major, b * seq_len + s) the
   experts in choice order with their combine weights, and whether capacity kept them. Return the
   capacity per expert if the router has one.

Run routing in float32 on the CPU (or set torch.use_deterministic_algorithms(True)): CUDA top-k
is not stable on ties, which the D probe would rightly report.
"""

import numpy as np
import torch

from moe_audit import routes_from_arrays, run

EXPERTS, TOP_K, HIDDEN = 8, 2, 64


class TopKRouter(torch.nn.Module):
    """Stand-in for your router (1): replace by your module, e.g. Megatron's TopKRouter."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)

    def forward(self, hidden):  # [tokens, hidden] -> (probs [tokens, k], experts [tokens, k])
        probs = torch.softmax(self.gate(hidden), dim=-1)
        return torch.topk(probs, TOP_K, dim=-1)


torch.manual_seed(0)
MODULE = TopKRouter()
# MODULE.load_state_dict(torch.load("router.pt"))  # (1) your trained weights


@torch.no_grad()
def route(data, mode):
    MODULE.train(mode == "train")  # (2)
    hidden = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, HIDDEN)
    weights, experts = MODULE(hidden)
    # (3) a token-dropping router also returns which routes were kept, and its capacity:
    #     return routes_from_arrays(experts, weights, kept), [capacity] * EXPERTS
    return routes_from_arrays(experts.numpy(), weights.numpy()), None


if __name__ == "__main__":
    run(route, name="torch-router", experts=EXPERTS, top_k=TOP_K, input="hidden", hidden_size=HIDDEN)
