"""Rollout actors: the rollout loop, the evaluator process, the ZeroMQ sender (engines live in `engines/`,
reward functions in `rewards/`)."""
