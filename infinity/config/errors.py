"""The config layer's exception (its own module, so every config module can raise it without a cycle)."""


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key path and what is allowed."""
