"""The package's own error types: each message names what to fix."""


class K2VecError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(K2VecError):
    """An invalid config: the message starts with the dotted key at fault."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"config key '{key}': {reason}")
