"""Starting a call's forwards mid-stack (plan.Start; the engine's `start_midstack`).

A call whose requests all start at layer S sets the decoder's `start_layer` to S for the call:
vLLM's decoders loop over `layers[start_layer:]` (its pipeline-parallel split), so nothing below S
runs, and a pre-hook on layer S hands it, row by row, the cached stream entering S (with any patch
on that stream written in). The start layer is put back when the call ends, however it ends.
Transformers' decoders (vLLM's Transformers backend) loop over every layer instead: the layers
below S are swapped for stand-ins that pass the stream on, and put back likewise.
"""
from __future__ import annotations

import torch

from ...model.sites import Family, get_module
from ...plan import stream_key
from .hooks import put, unbatched


class StandIn(torch.nn.Module):
    """Stands in for a layer below the start in a decoder that loops over every layer (transformers'
    own, in vLLM's Transformers backend): hands the stream on without computing anything, and the
    start layer's pre-hook then replaces it with the cached stream."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


STAND_IN = StandIn()


def start_by(family: Family, decoder, layers) -> str | None:
    """How a forward of this model starts mid-stack: "start_layer" (vLLM's decoders loop over
    layers[start_layer:], its pipeline-parallel split), "stand_ins" (transformers' decoder in vLLM's
    Transformers backend loops over every layer: the ones below are swapped for `StandIn`), or None."""
    if family.stream_arg is None:
        return None
    if getattr(decoder, "start_layer", None) == 0:
        return "start_layer"
    if family.vllm_transformers and isinstance(layers, torch.nn.ModuleList):
        return "stand_ins"
    return None


def current_start_layer(family: Family, model) -> int:
    """The layer the model's forwards start at now (0 between calls)."""
    decoder = get_module(model, family.decoder)
    if hasattr(decoder, "start_layer"):
        return decoder.start_layer
    layers = get_module(model, family.layers)
    return next((i for i, m in enumerate(layers) if not isinstance(m, StandIn)), len(layers))


class MidstackStart:
    """A call's start layer (mixed into session.Session, whose state it reads: `model`, `family`,
    `handles`, `start_layer`, and `step`, the current step's Step, whose `start` holds the rows and
    values of the stream entering the start layer)."""

    _decoder = None  # the decoder whose start_layer this call set
    _stood_in = None  # (layers, the layers below the start) while stand-ins run in their place

    def _start_at(self, layer: int):
        decoder = get_module(self.model, self.family.decoder)
        layers = get_module(self.model, self.family.layers)
        how = start_by(self.family, decoder, layers)
        if how is None:
            raise RuntimeError(f"patchgrid worker: the {self.family.name} decoder cannot start at layer {layer} here")
        # first among the layer's pre-hooks: a patch or capture of the stream entering it (resid_pre)
        # sees the cached stream
        self.handles.append(layers[layer].register_forward_pre_hook(
            unbatched(self._on_start, self.family.vllm_transformers), prepend=True))
        if how == "start_layer":
            self._decoder = decoder
            decoder.start_layer = layer
        else:  # put back in _restore_start(), however the call ends
            self._stood_in = (layers, [layers[i] for i in range(layer)])
            for i in range(layer):
                layers[i] = STAND_IN

    def _restore_start(self):
        if self._decoder is not None:
            self._decoder.start_layer = 0
            self._decoder = None
        if self._stood_in is not None:
            layers, originals = self._stood_in
            for i, module in enumerate(originals):
                layers[i] = module
            self._stood_in = None

    def _on_start(self, module, args):
        """Layer `start_layer`'s input becomes the cached stream (the layers below did not run)."""
        step = self.step
        if step.start is None:  # profiling and dummy runs
            return None
        i = self.family.stream_arg
        stream = args[i].clone()
        put(stream, *step.start, "the start stream")
        key = stream_key(self.start_layer)
        w = step.writes.get(key)
        if w is not None:
            put(stream, w[0], w[1], key)
        self._capture(key, lambda a, b: stream[a:b])
        return args[:i] + (stream,) + args[i + 1:]
