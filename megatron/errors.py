"""The error types for what a user can fix (config, data, paths, storage), with their exit codes."""


class ConfigError(Exception):
    """A user mistake: the message is one line naming the key/file/line and the fix."""

    exit_code = 2


class StorageError(ConfigError):
    """Storage refused a write (no space, read-only): one line naming the directory, the bytes
    needed and free; whatever was being written is removed, the previous state kept."""

    exit_code = 4
