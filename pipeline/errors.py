"""The lowest layer: the error every layer above raises for a bad configuration or input."""


class ConfigError(ValueError):
    """A bad configuration: one line that names the key (and file)."""
