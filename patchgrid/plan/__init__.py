"""What one engine request asks for, checked before anything runs.

A request is one forward pass over `tokens`. It may
- overwrite sites with values captured earlier from another prompt (`patches`, read from the
  `sources` handed to the engine call, by source name and site key),
- add seeded Gaussian noise to the embedding output at given positions (`noise`),
- capture sites over all positions (`capture`, site keys such as `resid.3`), recorded after
  this request's own patches are applied,
- read the logits (and ranks) of `answers` at the last prompt position, and the top `top_k` tokens,
- score `continuations` after the prompt, teacher-forced: each continuation's log-probability
  token by token (one forward per continuation of several tokens; prompt + its tokens but the last),
- measure the KL divergence at the last prompt position from the log-probabilities a source holds
  (`reference`, its `LOGPROBS` entry), and return its own (`logprobs`),
- patch one head's attention pattern from a source (a `pattern` patch: the head's output becomes that
  pattern applied to this run's own values), or block attention edges (`knockout`),
- run a circuit (`circuit`): every edge outside it (patchgrid.methods.graph) carries its sender's output
  from a source instead of this run's (backends.edge_ablation),
- say where it may start (`start`): when everything below a layer computes exactly what a cached
  run computed, an engine may begin the forward at that layer from the run's stream instead of
  recomputing it. The result is the same either way; the reference backend always runs it all.

Patches and noise address prompt positions only (a `whole` patch: every row of the request).
A request whose continuations have several tokens runs as several forwards (`forwards`), which
agree on the prompt (attention is causal); its captures and start streams cover them all in one
"tree" of rows: the prompt's positions, then each such continuation's inputs past the prompt in
turn (`tree_len`).

The package's modules, one job each:
- request.py   the request, its patches, noise and start, and the result it gets back
- forwards.py  how a request splits into forwards over the tree of rows, and joins back
- checks.py    `validate`: every out-of-range request refused, naming the field, before anything runs
- wire.py      a request and tensors as plain data, for vLLM's worker (a call's plans and sources,
               through collective_rpc)
"""
from .checks import PlanError, validate
from .forwards import (
    Forward,
    call_forwards,
    forwards,
    join_forwards,
    patch_rows,
    resolve_positions,
    tree_len,
    tree_rows,
)
from .request import (
    LOGPROBS,
    Circuit,
    Knockout,
    Noise,
    Patch,
    Request,
    Result,
    Start,
    gaussian_noise,
    latest_start,
    recomputed_heads,
    replaced,
    stream_key,
    trace_seed,
)
from .wire import (
    WirePlan,
    decode_array,
    decode_tensor,
    encode_array,
    encode_tensor,
    from_wire,
    to_columns,
    to_wire,
)

__all__ = [
    "LOGPROBS", "Circuit", "Forward", "Knockout", "Noise", "Patch", "PlanError", "Request", "Result",
    "Start", "WirePlan", "call_forwards", "decode_array", "decode_tensor", "encode_array", "encode_tensor", "forwards",
    "from_wire", "gaussian_noise", "join_forwards", "latest_start", "patch_rows", "recomputed_heads", "replaced",
    "resolve_positions", "stream_key", "to_columns", "to_wire", "trace_seed", "tree_len", "tree_rows", "validate",
]
