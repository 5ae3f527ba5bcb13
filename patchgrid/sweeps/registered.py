"""SWEEP_KINDS: every sweep kind by name, filled by sweeps.registry as it imports the kinds (and by
a kind registered at run time). It sits below the kinds and their settings, so that the settings
(sweeps.config) check the kinds a run names without importing the kinds that read those settings."""
from __future__ import annotations

SWEEP_KINDS: dict = {}  # name -> sweeps.base.SweepKind
