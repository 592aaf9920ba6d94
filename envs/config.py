"""The job's `env` section: which environment plays multi-turn episodes, and the limits of an episode."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from envs.registry import get_env_class
from runbase.configload import ConfigError

# Threads that run environment steps (tool calls) for one actor: episodes waiting on a tool hold one each.
DEFAULT_ENV_WORKERS = 16


@dataclass(kw_only=True)
class EpisodesConfig:
    """Multi-turn episodes. Empty `name`: single-turn (one prompt, one completion, the record's reward function)."""

    name: str = ""
    """A registered environment (envs/registry.py: calculator_reverse, python_tool) or a class of one's own as
    `package.module:ClassName`. Set, every sample is an episode: the environment answers each assistant turn
    until it ends the episode, and the learner trains on the model's tokens only."""
    options: dict = field(default_factory=dict)
    """The environment's own settings: the keyword arguments of its config class (EnvConfig's max_turns,
    tool_timeout_s, end_on_tool_error, observation_role, max_observation_chars, and the class's own)."""
    max_episode_tokens: int = 0
    """Response tokens an episode may hold (the model's and the environment's after the prompt); an episode that
    would pass it ends with reason `max_episode_tokens`. 0: buffer.max_response_tokens."""
    workers: int = DEFAULT_ENV_WORKERS
    """Threads per actor that run environment steps, so a slow tool never holds up the engine's loop."""

    def __post_init__(self):
        if self.max_episode_tokens < 0:
            raise ConfigError("max_episode_tokens", f"must be >= 0, got {self.max_episode_tokens}")
        if not 1 <= self.workers <= 256:
            raise ConfigError("workers", f"must be in 1..256, got {self.workers}")
        if self.name:
            self.env_config()   # an unknown environment or option fails as the configuration loads

    @property
    def multi_turn(self) -> bool:
        return bool(self.name)

    def env_class(self):
        try:
            return get_env_class(self.name)
        except (KeyError, ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError("name", str(e).strip('"')) from None

    def env_config(self):
        """The environment's config object built from `options` (validated by its own __post_init__)."""
        cls = self.env_class().config_class
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(self.options) - known):
            raise ConfigError("options", f"{self.name} has no setting {', '.join(unknown)}; its settings: "
                              f"{', '.join(sorted(known))}")
        try:
            return cls(**self.options)
        except ConfigError as e:
            raise ConfigError(f"options.{e.key}", e.message) from None

    def episode_tokens(self, buffer_cfg) -> int:
        """The response tokens an episode may hold: max_episode_tokens, or the buffer's max_response_tokens."""
        return self.max_episode_tokens or buffer_cfg.max_response_tokens

    def make(self, runner=None):
        """A new environment instance (one per episode in flight), sharing the process's tool `runner`."""
        return self.env_class()(self.env_config(), runner=runner)
