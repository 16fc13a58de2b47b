"""A tiny MoE layer on plain torch.distributed (no framework) served with moe_audit.distributed,
for the server's own tests: top-2 of a fixed gate, capacity per rank over its tokens (first come,
Megatron's C = ceil(T * k / E)), output = sum of kept gate * (x @ W_e). FAULT=raise|hang|exit makes
rank 1 fail, hang or leave quietly on its second call."""

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from moe_audit import distributed

E, K, H = 4, 2, 8


class Fake:
    name, experts, top_k, hidden_size, output_dtype = "fake-ep", E, K, H, "float32"

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.gate = torch.randn(H, E, generator=g)
        self.w = torch.randn(E, H, H, generator=g)
        self.calls = 0

    def forward(self, hidden, mode, seed):
        self.calls += 1
        fault = os.environ.get("FAULT")
        if dist.get_rank() == 1 and self.calls == 2 and fault:
            if fault == "raise":
                raise RuntimeError("injected failure")
            if fault == "hang":
                time.sleep(3600)
            if fault == "exit":
                sys.exit(0)
        x = hidden.reshape(-1, H)
        probs = torch.softmax(x @ self.gate, dim=-1)
        w, e = torch.topk(probs, K, dim=-1)
        cap = -(-x.shape[0] * K // E)
        kept = torch.zeros_like(e, dtype=torch.bool)
        used = [0] * E
        for t in range(x.shape[0]):
            for j in range(K):
                if used[int(e[t, j])] < cap:
                    used[int(e[t, j])] += 1
                    kept[t, j] = True
        out = torch.zeros_like(x)
        for j in range(K):
            out += (kept[:, j] * w[:, j])[:, None] * torch.einsum("th,thg->tg", x, self.w[e[:, j]])
        dist.all_reduce(torch.zeros(1))  # a collective in every forward, as an EP layer has
        return distributed.Local(e.numpy(), w.double().numpy(), kept.numpy(), cap, out.numpy().astype(np.float32))

    def fingerprint(self):
        return distributed.fingerprint_of([self.gate.numpy().tobytes(), self.w.numpy().tobytes()])


dist.init_process_group("gloo")
distributed.run_driver(Fake(), os.environ.get("PLACEMENT", "contiguous"))
