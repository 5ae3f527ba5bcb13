"""The part of the vLLM backend that runs inside vLLM's worker (a worker extension).

Per engine call: `pg_begin` receives the patch sources and the call's plans, reads every plan into
the call's columns and installs hooks; vLLM then runs its
scheduler steps, each a flattened batch of rows from many requests; `pg_end` removes the hooks
and returns the call's results (arrays by plan, and the parts of forwards that read more).
patchgrid/backends/README.md follows one request through these modules:

- `extension`: the RPC face, `PatchgridWorker` (the class vLLM mixes into its worker).
- `kernels`: vLLM's C kernels for the RMS norms, put in the eager forward on a CPU.
- `session`: one call's state: the sources, the sites' widths on this rank, the call's columns.
- `columns`: the call's plans as arrays by plan, and flat tables of their patches, scores and starts.
- `request`: the stacked sources, the request ids naming plans, and the forwards that hold more.
- `step`: per-step planning: which rows of the flattened batch are which request's positions.
- `hooks`: reading and writing each site where vLLM holds it.
- `midstack`: starting a call's forwards at a later layer.
- `readout`: the logits read from the last prompt position on, and the numbers taken from them.
- `results`: the call's readings, by plan, in arrays the readout writes and `pg_end` returns.
"""
