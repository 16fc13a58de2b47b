"""Records what every router of a model decides, one dict per forward of the model."""

from contextlib import contextmanager

import torch

from .routers import decoder_for


def dispatch_args(site, args, kwargs):
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

    def __init__(self, model):
        self.model = model
        self.calls = []
        self._seen = {}

    def _router(self, site):
        def hook(module, args, output):
            self._seen[site.layer] = [args, output, None]
        return hook

    def _experts(self, site):
        def hook(module, args, kwargs):
            seen = self._seen.get(site.layer)
            if seen is not None and seen[2] is None:
                seen[2] = dispatch_args(site, args, kwargs)
        return hook

    def _root(self, module, args, output):
        call = {}
        for site in self.model.sites:
            seen = self._seen.pop(site.layer, None)
            if seen is None:
                continue  # a layer this forward did not reach (a dense step, an MTP head left out)
            inputs, out, dispatch = seen
            if site.decoder is None:
                site.decoder = decoder_for(site.module, out)
            call[site.layer] = site.decode(inputs, out, dispatch)
        self._seen.clear()
        self.calls.append(call)


@contextmanager
def capture(model):
    """Inside, every forward of ``model.root`` appends ``{layer: Decoded}`` (every router it
    ran) to the returned recorder's ``calls``."""
    recorder = Recorder(model)
    handles = []
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
