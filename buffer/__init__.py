"""Trajectory buffer: wire schema, ingest and storage of rollout groups."""
