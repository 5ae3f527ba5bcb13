"""Attribution patching: the gradient estimate against finite differences of the same
linearisation, against exact patches where the metric is linear in the site, and the atp sweep's
verification against direct patches on vLLM."""
from __future__ import annotations

import pytest
import torch

from patchgrid.methods.attribution import Attributor
from patchgrid.model.models import prepare
from patchgrid.model.sites import shape_of
from patchgrid.sweeps import SweepConfig
from tests.support.pairs import shipped_pairs


def _model64(model):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(prepare(model), dtype=torch.float64)
    return m.eval(), shape_of(m.config)


def test_bad_site_kinds_and_corrections_are_refused(tokenizers):
    m, shape = _model64("tiny-llama")
    att = Attributor(m, shape)
    pairs = shipped_pairs(tokenizers("tiny-llama"), 1)
    with pytest.raises(ValueError, match="not 'embed'"):
        att.estimate(pairs, ("embed",))
    with pytest.raises(ValueError, match="unknown correction 'qk'"):
        att.estimate(pairs, ("resid",), correction="qk")
    with pytest.raises(ValueError, match="unknown atp kind 'head'"):
        SweepConfig(sweeps=("atp",), atp_kinds=("head",))

