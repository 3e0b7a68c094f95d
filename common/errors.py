"""Failures the scripts report as one line (`error: ...`) instead of a traceback.

Every module of common/ may import this one; it imports nothing of the project."""


class RunError(Exception):
    """A failure with a cause the user can act on: the scripts print its message and exit 1."""


class ConfigError(RunError, ValueError):
    """Bad input from the user: flags, model path, task, reward function, checkpoint."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
