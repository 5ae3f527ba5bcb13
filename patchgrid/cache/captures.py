"""`CacheSpec`: what a study's sweeps need captured, and from which runs."""
from __future__ import annotations

from dataclasses import dataclass

from ..model.sites import site_key
from ..plan import stream_key

NOISED = "noised."  # run names noised.0, noised.1, ...: causal tracing's noised runs, one per sample


@dataclass(frozen=True)
class CacheSpec:
    """What a study's sweeps need captured: `keys` from every run of `runs`, and from some runs
    more (`more`: (run, keys)). A run named noised.<s> is the clean prompt with causal tracing's
    noise of sample s, drawn with `noise` = (std, seed)."""

    keys: tuple[str, ...]  # site keys, e.g. resid.0 ... resid.29, embed
    runs: tuple[str, ...] = ("clean",)
    more: tuple[tuple[str, tuple[str, ...]], ...] = ()
    noise: tuple[float, int] | None = None

    @classmethod
    def of_manifest(cls, manifest: dict) -> CacheSpec:
        """What a cache data set holds, read from its manifest."""
        noise = manifest.get("noise")
        return cls((), (), tuple((run, tuple(keys)) for run, keys in manifest["captured"].items()),
                   None if noise is None else tuple(noise))

    def captured(self) -> dict[str, tuple[str, ...]]:
        """run -> the site keys captured from it; clean (the baseline) always runs."""
        out: dict[str, tuple[str, ...]] = {"clean": ()}
        for run in self.runs:
            out[run] = tuple(self.keys)
        for run, keys in self.more:
            out[run] = tuple(dict.fromkeys(out.get(run, ()) + tuple(keys)))
        return out

    def noised(self) -> bool:
        return any(run.startswith(NOISED) for run in self.captured())

    def covered_by(self, other: CacheSpec) -> bool:
        theirs = other.captured()
        if any(not set(keys) <= set(theirs.get(run, ())) or run not in theirs
               for run, keys in self.captured().items()):
            return False
        return not self.noised() or self.noise == other.noise

    def merge(self, other: CacheSpec) -> CacheSpec:
        if self.noise and other.noise and self.noise != other.noise:
            raise ValueError(f"two noise settings for the noised runs: {self.noise} and {other.noise}")
        mine, theirs = self.captured(), other.captured()
        runs = {run: tuple(dict.fromkeys(mine.get(run, ()) + theirs.get(run, ()))) for run in {**mine, **theirs}}
        return CacheSpec((), (), tuple(runs.items()), self.noise or other.noise)


def layer_keys(site: str, n_layers: int) -> tuple[str, ...]:
    return tuple(site_key(site, layer) for layer in range(n_layers))


def stream_keys(n_layers: int) -> tuple[str, ...]:
    """The stream entering each layer a patched run can start at (1 .. n_layers - 1)."""
    return tuple(stream_key(layer) for layer in range(1, n_layers))
