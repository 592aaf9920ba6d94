"""Staleness sweeps, the synchronous baseline and the cluster simulator (DESIGN.md, experiments/)."""
