"""Records what every router of a model decides, one dict per forward of the model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from .routers import Decoded, Dispatch, Inputs, Model, Site


def dispatch_args(site: Site, args: Inputs, kwargs: dict[str, Any]) -> Dispatch:
    """(ids [T, k], weights [T, k]) among the arguments an experts module was called with."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    ids = next((t for t in tensors if not t.is_floating_point() and t.ndim == 2 and 0 < t.shape[-1] < site.experts),
               None)
    if ids is None:
        return None
    weights = next((t for t in tensors if t.is_floating_point() and t.shape == ids.shape), None)
    return None if weights is None else (ids, weights)


class Recorder:
    """``calls``: one ``{layer: Decoded}`` per forward of the model's root module."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.calls: list[dict[int, Decoded]] = []
        #: Per layer of the forward in progress: [router inputs, router output, dispatch].
        self._seen: dict[int, list[Any]] = {}

    def _router(self, site: Site) -> Callable[[torch.nn.Module, Inputs, Any], None]:
        def hook(module: torch.nn.Module, args: Inputs, output: Any) -> None:
            self._seen[site.layer] = [args, output, None]
        return hook

    def _experts(self, site: Site) -> Callable[[torch.nn.Module, Inputs, dict[str, Any]], None]:
        def hook(module: torch.nn.Module, args: Inputs, kwargs: dict[str, Any]) -> None:
            seen = self._seen.get(site.layer)
            if seen is not None and seen[2] is None:
                seen[2] = dispatch_args(site, args, kwargs)
        return hook

    def _root(self, module: torch.nn.Module, args: Inputs, output: Any) -> None:
        call: dict[int, Decoded] = {}
        for site in self.model.sites:
            seen = self._seen.pop(site.layer, None)
            if seen is None:
                continue  # a layer this forward did not reach (a dense step, an MTP head left out)
            inputs, out, dispatch = seen
            call[site.layer] = site.decode(inputs, out, dispatch)
        self._seen.clear()
        self.calls.append(call)


@contextmanager
def capture(model: Model) -> Iterator[Recorder]:
    """Inside, every forward of ``model.root`` appends ``{layer: Decoded}`` (every router it
    ran) to the returned recorder's ``calls``."""
    recorder = Recorder(model)
    handles: list[RemovableHandle] = []
    try:
        for site in model.sites:
            handles.append(site.module.register_forward_hook(recorder._router(site)))
            if site.experts_module is not None:
                handles.append(site.experts_module.register_forward_pre_hook(recorder._experts(site), with_kwargs=True))
        handles.append(model.root.register_forward_hook(recorder._root))
        yield recorder
    finally:
        for h in handles:
            h.remove()
