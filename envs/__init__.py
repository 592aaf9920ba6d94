"""Multi-turn episodes: environments that take an assistant's turns and answer with observations and rewards
(core), tools run off the caller's thread and code in a sandbox (tools), environments by name (registry)."""
