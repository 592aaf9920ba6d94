"""Rollout actors: engine backends, the rollout loop, rewards, the ZeroMQ sender."""
