"""Audit a TorchTitan MoE layer (``torchtitan.models.common.moe.MoE``) as it runs, on one rank or
expert-parallel over the ranks of a ``torch.distributed.run`` launch (``moe-audit/2``).

::

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    import moe_audit.torchtitan as mtt

    set_spmd_backend("partial_dtensor")              # EP on gloo (see below)
    dist.init_process_group("gloo")
    moe = MoE.Config(...).build()                     # with an AllToAllTokenDispatcher
    mtt.seed_weights(moe, seed=0)                     # the same layer at EP 1, 2, 4
    mtt.expert_parallel(moe, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
    mtt.run(moe)

serves the layer to ``moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone
--nproc_per_node 2 this_file.py"`` (:func:`moe_audit.distributed.run_driver`: rank 0 speaks the
protocol, every rank routes its own sequences). A layer parallelised by TorchTitan itself
(``moe.parallelize(parallel_dims)``: DTensor expert weights sharded over the ``ep`` mesh) is served
the same way, and so is a layer in one process (no launch, no process group).

Each call runs the layer's own forward, ``moe(x)`` on this rank's ``[b_local, S, H]`` rows after
``.train()`` or ``.eval()``, under ``torch.no_grad()``, and reports what it computed: the routes as
the router returned them (a forward hook on ``TokenChoiceTopKRouter``) and the layer's output rows.
File:line references are torchtitan 0.3.0's (the PyPI release), under ``torchtitan/``:

- experts: ``topk_expert_ids_BLK`` in the router's order (``torch.topk(..., sorted=False)``,
  ``models/common/moe.py:318-320``; descending on the CPU). They are chosen from the scores plus
  ``expert_bias_E`` (``moe.py:310-312``, passed in at ``moe.py:426``): the aux-loss-free balancing
  bias moves the choice only;
- weights: ``topk_scores_BLK``, gathered from the scores *without* the bias (``moe.py:322-324``),
  then ``route_norm`` and ``route_scale`` (``moe.py:333-336``): the weights the combine multiplies
  each expert's output by (``models/common/token_dispatcher.py:158-161``, ``:616-619``);
- kept: every route. The router and the dispatchers are dropless: each token's k rows are all
  dispatched (``token_dispatcher.py:92-100``: N = T * K) and combined; capacity None;
- output: the layer's output rows (shared experts included), sent as float32. The routed experts
  compute in bfloat16 whatever the parameters' dtype (``GroupedExperts.forward``, ``moe.py:94-108``:
  inputs and weights ``.bfloat16()`` into ``torch._grouped_mm``), so ``output_dtype`` is
  ``"bfloat16"`` (measured on the CPU: bit-equal to a bfloat16 reference, 1e-2 relative from a
  float32 one).

Nothing in the forward draws random numbers, so the request's seed is not used. In training mode
the forward adds to ``tokens_per_expert_E`` (``moe.py:444-446``), a counter that moves the bias only
in the optimizer's step pre-hook (``components/optimizer/optimizer.py:447``), which an audit never
runs: the bias in force is the one the layer was handed.

Expert parallelism on a CPU: the ``AllToAllTokenDispatcher`` exchanges tokens with the functional
``all_to_all_single`` only when the SPMD backend is not TorchTitan's default ``"spmd_types"``
(``distributed/utils.py:36``, ``token_dispatcher.py:258-266``, ``:325-333``); the default path asks
a current SPMD mesh for its group (``token_dispatcher.py:434-440``) and sends uneven splits with the
list ``all_to_all``, which gloo refuses. ``set_spmd_backend("partial_dtensor")`` before the first
forward is what EP on gloo needs. Rank r of the ``ep`` mesh holds experts ``[r * e, (r + 1) * e)``
(the counts are split ``view(ep_size, -1)`` by destination, ``token_dispatcher.py:262``,
``:296-297``). Needs torch and torchtitan (``pip install --no-deps torchtitan==0.3.0
spmd_types==0.2.3`` and ``pip install tyro``: what these modules import).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher

from . import distributed

# The routed experts' parameters, their first dimension the expert (``moe.py:45-53``).
_EXPERTS = "routed_experts.inner_experts."


def _moe(module: Any) -> MoE:
    if not isinstance(module, MoE):
        raise TypeError(f"moe_audit.torchtitan: expected a torchtitan MoE (torchtitan.models.common.moe.MoE), "
                        f"got {type(module).__name__}")
    return module


def _ep_mesh(moe: MoE) -> DeviceMesh | None:
    """The ``ep`` mesh wired into the layer's dispatcher (``token_dispatcher.py:186``, ``:194``);
    None at EP 1 (``LocalTokenDispatcher`` has none)."""
    mesh: DeviceMesh | None = getattr(moe.routed_experts.token_dispatcher, "ep_mesh", None)
    return mesh


def _ep_size(moe: MoE) -> int:
    mesh = _ep_mesh(moe)
    return 1 if mesh is None else mesh.size()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A router output or parameter as this rank's plain tensor: a replicated DTensor's local copy."""
    if isinstance(t, DTensor):
        if not all(p.is_replicate() for p in t.placements):
            raise ValueError(f"moe_audit.torchtitan: a router output sharded as {t.placements} (sequence or "
                             "tensor parallel) is not supported: only expert parallelism")
        return t.to_local()
    return t


def _global_experts(moe: MoE, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or buffer at its global shape on every rank (a collective for the experts' weights
    held in slices): a DTensor's ``full_tensor()``; a plain slice of the routed experts gathered over
    the ``ep`` mesh, rank order being expert order."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    mesh = _ep_mesh(moe)
    if mesh is None or not name.startswith(_EXPERTS):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(mesh.size())]
    dist.all_gather(parts, tensor.contiguous(), group=mesh.get_group())
    return torch.cat(parts)


def _check_experts(moe: MoE) -> None:
    """The routed experts' weights hold this rank's share of the router's experts (all of them at EP 1)."""
    ranks = _ep_size(moe)
    experts = int(moe.router.num_experts)
    for name, p in moe.named_parameters():
        if name.startswith(_EXPERTS) and not isinstance(p, DTensor) and p.shape[0] * ranks != experts:
            raise ValueError(f"moe_audit.torchtitan: {name} holds {p.shape[0]} experts on each of {ranks} "
                             f"expert-parallel rank(s), the router chooses among {experts}"
                             + (" (expert_parallel(moe, ep_mesh) keeps each rank's share)" if ranks > 1 else ""))


class Driver:
    """A TorchTitan ``MoE`` as a :class:`moe_audit.distributed.Driver`: ``forward(hidden, mode, seed)``
    on this rank's sequences, ``fingerprint()``, and the handshake attributes."""

    output_dtype = "bfloat16"  # GroupedExperts' grouped matmuls (module docstring)

    def __init__(self, module: Any, *, name: str | None = None) -> None:
        self.moe = _moe(module)
        router = self.moe.router
        self.experts = int(router.num_experts)
        self.top_k = int(router.top_k)
        self.hidden_size = int(router.gate.in_features)
        self.name = name or f"torchtitan-{router.score_func}-top{self.top_k}-ep{_ep_size(self.moe)}"
        _check_experts(self.moe)
        self._routes: tuple[torch.Tensor, torch.Tensor] | None = None
        router.register_forward_hook(self._capture)

    def __repr__(self) -> str:
        r = self.moe.router
        return (f"moe_audit.torchtitan.Driver({self.experts} experts, top {self.top_k}, hidden {self.hidden_size}, "
                f"{r.score_func}, route_norm {r.route_norm}, route_scale {r.route_scale}, expert bias "
                f"{self.moe.expert_bias_E is not None}, EP {_ep_size(self.moe)})")

    def _capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # (topk_scores_BLK, topk_expert_ids_BLK, scores_BLE): moe.py:338-342
        self._routes = (_local(output[0]), _local(output[1]))

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, mode: str, seed: int | None = None) -> distributed.Local:
        """Runs the layer on this rank's ``[b_local, S, H]`` float32 rows in mode "train" or
        "inference" (collectively, on every rank at EP > 1); its routes and output rows."""
        del seed  # nothing in the forward is random
        self.moe.train(mode == "train")
        weight = _local(self.moe.router.gate.weight)
        x = hidden.to(device=weight.device, dtype=weight.dtype)
        self._routes = None
        out = self.moe(x)
        if self._routes is None:
            raise RuntimeError("moe_audit.torchtitan: the layer's forward did not call its router")
        scores, ids = self._routes
        tokens = x.shape[0] * x.shape[1]
        experts = ids.reshape(tokens, self.top_k).to(torch.int64).cpu().numpy()
        return distributed.Local(experts=experts,
                                 weights=scores.reshape(tokens, self.top_k).double().cpu().numpy(),
                                 kept=np.ones(experts.shape, dtype=bool), capacity=None,
                                 output=_local(out).reshape(tokens, self.hidden_size).float().cpu().numpy())

    def fingerprint(self) -> str:
        """The digest of every parameter and persistent buffer (router gate, ``expert_bias_E``, all
        experts in global expert order, shared experts), each by name, dtype, global shape and bytes:
        the same layer at any EP size gives the same digest. A collective; ranks that hold different
        router or shared weights are an error, not a digest."""
        parts = []
        for name, tensor in self.moe.state_dict().items():
            full = _global_experts(self.moe, name, tensor).detach().cpu().contiguous()
            parts += [f"{name} {full.dtype} {tuple(full.shape)}".encode(),
                      full.reshape(-1).view(torch.uint8).numpy().tobytes()]
        mine = distributed.fingerprint_of(parts)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            other = next((r for r, d in enumerate(every) if d != every[0]), None)
            if other is not None:
                raise RuntimeError(f"moe_audit.torchtitan: rank {other} holds other weights than rank 0 (the "
                                   "router, expert bias or shared experts differ across ranks)")
        return mine


def expert_parallel(module: Any, ep_mesh: DeviceMesh) -> MoE:
    """Spreads a layer built with all its experts over ``ep_mesh`` as ``RoutedExperts.parallelize``
    does without TorchTitan's ``ParallelDims``: each rank keeps its experts' rows of the routed
    experts' weights (rank r: ``[r * e, (r + 1) * e)``) and the mesh is wired into the dispatcher
    (``moe.py:187-189``), which must be an ``AllToAllTokenDispatcher`` (or another EP dispatcher)."""
    moe = _moe(module)
    dispatcher = moe.routed_experts.token_dispatcher
    if not isinstance(dispatcher, BaseEPTokenDispatcher):
        raise TypeError(f"moe_audit.torchtitan: the layer's {type(dispatcher).__name__} does not run expert-"
                        "parallel (build it with token_dispatcher=AllToAllTokenDispatcher.Config(...))")
    ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    experts = int(moe.router.num_experts)
    if experts % ranks:
        raise ValueError(f"moe_audit.torchtitan: {experts} experts do not divide over {ranks} expert-parallel ranks")
    share = experts // ranks
    inner = moe.routed_experts.inner_experts
    for name, p in list(inner.named_parameters(recurse=False)):
        kept = p.detach()[rank * share:(rank + 1) * share].clone()
        setattr(inner, name, torch.nn.Parameter(kept, requires_grad=p.requires_grad))
    dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return moe


@torch.no_grad()
def seed_weights(module: Any, seed: int = 0) -> MoE:
    """Every parameter drawn from N(0, 1 / fan_in) (fan_in: its last dimension) by one generator
    seeded with ``seed``, at its global shape, in the layer's parameter order; a rank holding a share
    of the experts keeps its rows. The same script therefore builds the same layer at EP 1, 2 and 4
    (GroupedExperts has no initialiser of its own: its weights start as ``torch.empty``,
    ``moe.py:45-53``). Buffers are left as built (``expert_bias_E`` zeros, ``moe.py:389-393``)."""
    moe = _moe(module)
    mesh = _ep_mesh(moe)
    ranks, rank = (1, 0) if mesh is None else (mesh.size(), mesh.get_local_rank())
    generator = torch.Generator().manual_seed(seed)
    for name, p in moe.named_parameters():
        if isinstance(p, DTensor):
            full = torch.randn(tuple(p.shape), generator=generator) * p.shape[-1] ** -0.5
            p.copy_(distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements))
            continue
        share = p.shape[0] if name.startswith(_EXPERTS) else None  # this rank's experts of ranks * share
        shape = (share * ranks, *p.shape[1:]) if share is not None else tuple(p.shape)
        full = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        p.copy_(full if share is None else full[rank * share:(rank + 1) * share])
    return moe


def wrap(moe: Any, **options: Any) -> Driver:
    """A :class:`Driver` for a TorchTitan ``MoE``: option ``name``."""
    return Driver(moe, **options)


def run(moe: Any, placement: str = "contiguous", **options: Any) -> None:
    """Serves the layer to moe-audit across the launch's ranks (every rank calls it, after the
    process group and the layer are built): ``distributed.run_driver(wrap(moe, **options), placement)``,
    placement ``"contiguous"`` or ``"strided"`` (:mod:`moe_audit.distributed`)."""
    distributed.run_driver(wrap(moe, **options), placement)


__all__ = ["Driver", "expert_parallel", "run", "seed_weights", "wrap"]
