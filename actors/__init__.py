"""Rollout actors: the rollout loop, rewards, the ZeroMQ sender (engines live in `engines/`)."""
