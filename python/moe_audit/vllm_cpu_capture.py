"""A vLLM plugin that makes ``--enable-return-routed-experts`` work on vLLM's CPU MoE kernel.

vLLM 0.28 returns each request's routed experts when served with ``--enable-return-routed-experts``,
but on the CPU its unquantized MoE layers run a monolithic kernel that never reports its ``topk_ids``,
so binding the capturer refuses to start (vllm 0.28.0
``model_executor/layers/fused_moe/routed_experts_capturer.py:283-291``). The kernel computes the ids
in Python first (``experts/cpu_moe.py:344-367``, ``CPUUnquantizedExperts._select_experts``, called
by ``apply`` at 386-393), so this plugin declares the kernel capable and hands those ids to the
callback vLLM binds (``modular_kernel.py:1007-1022``, ``set_capture_fn``). Everything else is
vLLM's: the capturer's per-step buffer, the scheduler's slot-indexed store (prefix-cache hits read
the rows stored when the blocks were filled), batching, chunked prefill and the response field.

The hand-over is a custom op, ``moe_audit::capture_topk_ids``, so that it survives compilation: on
the CPU vLLM traces the MoE layer, router included, into the model's graph (``moe_runner.py:297-302``;
``platforms/cpu.py:198-212``: Dynamo traced once, inductor) while warming up, before the capturer is
bound (``cpu_model_runner.py:150`` against ``gpu_worker.py:682-683``). A Python call there would be
traced with no callback and vanish; the op stays in the graph and looks the callback up at run time.
Its output (a copy of the ids) feeds the kernel, so the compiler cannot drop it. The AOT compile
cache key gets a factor of its own (``compilation/caching.py:573-589``, read by
``compilation/decorators.py:537-542``): a graph compiled without the op is never loaded with it.

Opt-in: registered as a ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM loads in
every process (``vllm/plugins/__init__.py:16-18,77-90``); it does nothing unless
``MOE_AUDIT_VLLM_CPU_CAPTURE=1``. When set and it cannot apply (another vLLM release, not the CPU
platform, the patched names absent), it says why in one line on stderr and changes nothing: the
server then starts, or refuses, exactly as vLLM alone would.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

ENV = "MOE_AUDIT_VLLM_CPU_CAPTURE"
# The releases whose lines the patch was read against (the docstring's citations).
SUPPORTED = ("0.28.0",)
_PATCHED = "_moe_audit_patched"
_KEY = "_moe_audit_capture_key"
# The experts of this process in construction order; an experts object's index is the constant its
# traced op carries. The order is the model's, the same in every process that builds it, so a graph
# loaded from the compile cache finds the layer it was traced for.
_EXPERTS: list[Any] = []


def register() -> None:
    """The entry point: patch vLLM's CPU MoE experts when ``MOE_AUDIT_VLLM_CPU_CAPTURE=1``."""
    value = os.environ.get(ENV)
    if value in (None, "", "0"):
        return
    if value != "1":
        print(f"moe-audit vllm plugin: {ENV}={value!r} is not 1 or 0; nothing patched", file=sys.stderr)
        return
    try:
        problem = apply()
    except Exception as e:  # noqa: BLE001 - in every vLLM process: one line, never a crashed server
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        print(f"moe-audit vllm plugin: cannot apply ({problem}); nothing patched", file=sys.stderr)


def apply() -> str | None:
    """Patch ``CPUUnquantizedExperts`` (idempotent); the reason it cannot, or None when patched."""
    try:
        import vllm
    except ImportError as e:
        return f"vllm does not import: {e}"
    version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED:
        return f"vllm {version}, read for {', '.join(SUPPORTED)}"
    try:
        from vllm.compilation import caching
        from vllm.model_executor.layers.fused_moe import modular_kernel
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.platforms import current_platform
    except ImportError as e:
        return f"vllm's MoE modules do not import: {e}"
    if not current_platform.is_cpu():
        return f"platform {type(current_platform).__name__} is not the CPU; vLLM's own capture applies there"
    experts = getattr(cpu_moe, "CPUUnquantizedExperts", None)
    monolithic = getattr(modular_kernel, "FusedMoEExpertsMonolithic", None)
    if (
        experts is None
        or monolithic is None
        or not issubclass(experts, monolithic)
        or not callable(getattr(experts, "_select_experts", None))
        or not hasattr(monolithic, "routing_replay_capture_fn")
        or not callable(getattr(caching, "aot_compile_hash_factors", None))
    ):
        return "vllm's CPU MoE experts lack _select_experts or the monolithic capture callback"
    if getattr(experts, _PATCHED, False):
        return None
    capture_op = _register_op()
    experts.__init__ = _keyed(experts.__init__)
    experts._select_experts = _forwarding(experts._select_experts, capture_op)
    # Read by bind_routed_experts_capturer (routed_experts_capturer.py:283-292) before it binds.
    experts.supports_routing_replay_capture = lambda self: True
    factors = caching.aot_compile_hash_factors
    caching.aot_compile_hash_factors = lambda config: [*factors(config), "moe_audit_vllm_cpu_capture"]
    setattr(experts, _PATCHED, True)
    return None


def _register_op() -> Callable[..., Any]:
    import torch

    # The schema spelled out: this module's annotations are strings (``from __future__``).
    schema = "(Tensor topk_ids, int key) -> Tensor"

    @torch.library.custom_op("moe_audit::capture_topk_ids", mutates_args=(), schema=schema)
    def capture_topk_ids(topk_ids: torch.Tensor, key: int) -> torch.Tensor:
        """Hands ``topk_ids`` (int32, one row per token of the step) to the callback bound to
        experts ``key``, which writes them into the capturer's buffer for its layer
        (``routed_experts_capturer.py:108-222``); unbound (warm-up, flag off) it does nothing."""
        capture = _EXPERTS[key].routing_replay_capture_fn
        if capture is not None:
            capture(topk_ids)
        return topk_ids.clone()

    @capture_topk_ids.register_fake
    def _(topk_ids: torch.Tensor, key: int) -> torch.Tensor:
        return torch.empty_like(topk_ids)

    return torch.ops.moe_audit.capture_topk_ids


def _keyed(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def init_and_key(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        setattr(self, _KEY, len(_EXPERTS))
        _EXPERTS.append(self)

    return init_and_key


def _forwarding(select: Callable[..., Any], capture_op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(select)
    def select_and_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = select(self, *args, **kwargs)
        key = getattr(self, _KEY, None)
        if key is None:
            raise RuntimeError("moe-audit vllm plugin: MoE experts built before the plugin applied")
        return topk_weights, capture_op(topk_ids, key)

    return select_and_capture
