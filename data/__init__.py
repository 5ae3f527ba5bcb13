"""Data sets shipped with patchgrid (installed as patchgrid.data); see README.md here."""
