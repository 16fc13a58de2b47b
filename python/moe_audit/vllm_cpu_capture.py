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
_MARK = "_moe_audit_capture"


def register() -> None:
    """The entry point: patch vLLM's CPU MoE experts when ``MOE_AUDIT_VLLM_CPU_CAPTURE=1``."""
    value = os.environ.get(ENV)
    if value in (None, "", "0"):
        return
    if value != "1":
        print(f"moe-audit vllm plugin: {ENV}={value!r} is not 1 or 0; nothing patched", file=sys.stderr)
        return
    problem = apply()
    if problem is not None:
        print(f"moe-audit vllm plugin: cannot apply ({problem}); nothing patched", file=sys.stderr)


def apply() -> str | None:
    """Patch ``CPUUnquantizedExperts`` (idempotent); the reason it cannot, or None when patched."""
    try:
        import vllm
        from vllm.model_executor.layers.fused_moe import modular_kernel
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.platforms import current_platform
    except ImportError as e:
        return f"vllm does not import: {e}"
    version = getattr(vllm, "__version__", "unknown")
    if version not in SUPPORTED:
        return f"vllm {version}, read for {', '.join(SUPPORTED)}"
    if not current_platform.is_cpu():
        return f"platform {type(current_platform).__name__} is not the CPU; vLLM's own capture applies there"
    experts = getattr(cpu_moe, "CPUUnquantizedExperts", None)
    monolithic = getattr(modular_kernel, "FusedMoEExpertsMonolithic", None)
    if (
        experts is None
        or monolithic is None
        or not issubclass(experts, monolithic)
        or not callable(getattr(experts, "_select_experts", None))
        or not callable(getattr(monolithic, "set_capture_fn", None))
        or not hasattr(monolithic, "routing_replay_capture_fn")
    ):
        return "vllm's CPU MoE experts lack _select_experts or the monolithic capture callback"
    if getattr(experts, _MARK, False):
        return None
    experts._select_experts = _forwarding(experts._select_experts)
    # Read by bind_routed_experts_capturer (routed_experts_capturer.py:283-292) before it binds.
    experts.supports_routing_replay_capture = lambda self: True
    experts.set_capture_fn = _eager_only(monolithic.set_capture_fn)
    setattr(experts, _MARK, True)
    return None


def _eager_only(bind: Callable[..., Any]) -> Callable[..., Any]:
    """``set_capture_fn`` that refuses a compiled model. On the CPU vLLM traces the MoE layer,
    router included, into the model's graph (``moe_runner.py:297-302``: no opaque custom op there;
    ``platforms/cpu.py:198-212``: Dynamo, traced once) while warming up, before the capturer is bound
    (``cpu_model_runner.py:150`` against ``gpu_worker.py:682-683``): a compiled router would never
    call the callback and every row would stay zero. The worker binds under its config
    (``worker_base.py:325-329``)."""

    @functools.wraps(bind)
    def bind_if_eager(self: Any, capture_fn: Any) -> None:
        from vllm.config import CompilationMode, get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if capture_fn is not None and config is not None and config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError(
                "moe-audit vllm plugin: routed experts on the CPU need --enforce-eager "
                f"(compilation mode {config.compilation_config.mode.name} traces the router without the capture)"
            )
        bind(self, capture_fn)

    return bind_if_eager


def _forwarding(select: Callable[..., Any]) -> Callable[..., Any]:
    """``select`` that also hands its ``topk_ids`` (int32, one row per token of the step) to the
    callback vLLM bound, which writes them into the capturer's buffer for this layer
    (``routed_experts_capturer.py:108-222``)."""

    @functools.wraps(select)
    def select_and_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = select(self, *args, **kwargs)
        capture = self.routing_replay_capture_fn
        if capture is not None:
            capture(topk_ids)
        return topk_weights, topk_ids

    return select_and_capture
