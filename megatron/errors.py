"""The one error type for user mistakes (config, data, paths)."""


class ConfigError(Exception):
    """A user mistake: the message is one line naming the key/file/line and the fix."""
