"""Errors a user can act on.

Every ``UserError`` is printed by the CLI as one line (no traceback) and exits with status 2.
Its message names the key, file or row at fault and says what is expected.
"""


class UserError(Exception):
    """Bad configuration, data or input: the user can fix it from the message alone."""


class ConfigError(UserError):
    """A config key is unknown, or its value has the wrong type or range."""


class DataError(UserError):
    """A dataset file is missing or one of its rows is malformed."""


class RewardError(UserError):
    """A reward function cannot be loaded, or a score failed under the ``error`` policy."""


class RunStopped(Exception):
    """An alert rule's ``stop`` action ended the run after writing a checkpoint; the CLI
    exits with ``exit_status`` (3), which a supervisor does not restart."""

    exit_status = 3


class ProcessLost(Exception):
    """A process of the run died under it (a Ray trainer actor whose node was lost): a
    crash, said in one line with exit status 1, which ``--max-restarts`` restarts from the
    newest checkpoint."""

    exit_status = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers, Kubernetes and torchrun send), raised in the main thread so
    the run ends as after Ctrl-C: a save in progress is abandoned and its temporary directory
    removed, the logs are flushed, and the CLI exits with 143 (128 + SIGTERM)."""

    exit_status = 143


def error_line(err: BaseException) -> str:
    """``Type: message``, its first line: how an error is named in an event."""
    return f"{type(err).__name__}: {err}".splitlines()[0]
