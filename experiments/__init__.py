"""Staleness sweeps, the synchronous baseline and the cluster simulator (docs/design.md, Layers)."""
