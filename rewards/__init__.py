"""Reward functions: pure scorers of a completion against a prompt's ground truth, chosen by the
prompt's `data_source` (`rewards/scorers.py`).

A layer of its own just above runbase: datasets check their scorers exist (data), actors score every
sample, the held-out evaluation scores the learner's policy (engines/evaluate.py), experiments and
benchmarks score baselines. It imports no other project package and no torch.
"""
