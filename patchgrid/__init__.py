"""patchgrid: activation-patching studies over many prompt pairs on vLLM."""

__version__ = "0.1.0"
