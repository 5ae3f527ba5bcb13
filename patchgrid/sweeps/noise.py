"""The noise causal tracing adds to the subject's embeddings, measured as Meng et al. do: scale
(3) x the standard deviation of the token embeddings of every subject in the data set, each
subject tokenized on its own. It depends on the data set and the model only, never on which pairs
a study keeps (`--limit`, `--require-known`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where it is used: the light commands import the sweeps and need no torch
    import torch


@dataclass(frozen=True)
class TraceNoise:
    std: float
    source: str  # how it was set, in words, as the run records it

    def recorded(self) -> dict:
        return {"trace_noise_std": self.std, "trace_noise": self.source}


def _embedding_weight(folder: Path) -> torch.Tensor:
    """The token embedding matrix as the `embed` site holds it, read from the checkpoint alone (not the
    whole model)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from ..model.sites import family_of

    config = AutoConfig.from_pretrained(folder)
    family = family_of(config.model_type)
    # a family that scales its embedding (Gemma) adds the noise to the scaled embedding
    scale = config.hidden_size ** 0.5 if family.embed_scaled else 1.0
    name = family.embed + ".weight"
    candidates = (name, name.split(".", 1)[1])  # some checkpoints drop the outer module's prefix
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / weight_map[c] for c in candidates if c in weight_map][:1]
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for c in candidates:
                if c in st.keys():
                    return st.get_tensor(c).float() * scale
    import torch
    from transformers import AutoModelForCausalLM  # an unusual checkpoint layout: load the model

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.get_input_embeddings().weight.detach() * scale


def subject_noise(folder: str | Path, subjects: list[str], scale: float) -> TraceNoise:
    """scale x the std of all token embeddings of `subjects` (each tokenized alone, no special tokens)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [i for s in subjects if s for i in tokenizer(s, add_special_tokens=False).input_ids]
    if not ids:
        raise ValueError("causal tracing needs subjects to measure its noise from: the data set has none")
    import torch

    weight = _embedding_weight(folder)
    std = float(weight[torch.tensor(ids)].std())
    n = sum(1 for s in subjects if s)
    return TraceNoise(scale * std, f"{scale:g} x std of the subjects' token embeddings ({n} subjects, "
                                   f"{len(ids)} tokens)")
