"""Benchmarks: each compares against the raw limit measured in the same run."""
