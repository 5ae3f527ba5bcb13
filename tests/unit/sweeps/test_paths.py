"""Path patching (patchgrid.sweeps.paths): the paths sweep on vLLM equals the hf reference on every
family, and equals an independent construction (the sender's difference added to the stream through
its own output projection) on the reference."""
from __future__ import annotations

import dataclasses

import pytest

from patchgrid.pairs.align import position_roles
from patchgrid.pairs.pair import Pair
from patchgrid.sweeps import SweepConfig

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)


CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)


PAIR = Pair("p0", None, CLEAN, CORRUPT, (5,), (77,), 2, 4, tuple(position_roles(8, 2, 4)))


EVERY = SweepConfig(sweeps=("paths",), path_senders=("heads", "attn_out", "mlp_out"),
                    path_receivers=("logits", "heads"))


def test_the_grid_names_both_ends():
    from patchgrid.sweeps import SWEEP_KINDS, SweepContext

    kind = SWEEP_KINDS["paths"]
    config = dataclasses.replace(EVERY, path_senders=("head.1.3", "mlp_out.2"), path_receivers=("logits", "head.3.1"))
    cells = kind.cells(PAIR, SweepContext(config, n_layers=4, n_heads=4, n_kv_heads=2))
    ends = {(c.site, c.layer, c.head, c.receiver) for c in cells}
    # a receiver reads q from its own head and k, v from the key/value head it shares (4 heads, 2 kv)
    assert ends == {("head", 1, 3, "logits"), ("head", 1, 3, "q.3.1"), ("head", 1, 3, "k.3.0"),
                    ("head", 1, 3, "v.3.0"), ("mlp_out", 2, None, "logits"), ("mlp_out", 2, None, "q.3.1"),
                    ("mlp_out", 2, None, "k.3.0"), ("mlp_out", 2, None, "v.3.0")}
    # every position at once, and the subject's last token and the last token (head positions)
    assert {c.position for c in cells} == {None, 3, 7}
    with pytest.raises(ValueError, match="outside the model"):
        kind.cells(PAIR, SweepContext(dataclasses.replace(config, path_senders=("head.9.0",)), 4, 4))
    for bad, match in [(dict(path_senders=("q.1.0",)), "a sender is a head"),
                       (dict(path_receivers=("mlp_out.1",)), "path receiver"),
                       (dict(path_inputs=()), "path input"), (dict(path_mlps="some"), "path_mlps")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(EVERY, **bad)

