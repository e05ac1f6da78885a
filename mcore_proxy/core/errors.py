"""One small exception family for bad input; the CLI catches it once and exits 2."""


class ProxyError(ValueError):
    """Bad input or usage. The message is one sentence naming the file and the fix."""


class CheckpointError(ProxyError):
    """A checkpoint folder is missing, truncated, or inconsistent."""


class StatsError(ProxyError):
    """A routing-statistics file is missing, truncated, or does not match the others."""


class PlanError(ProxyError):
    """A selection plan is infeasible or does not belong to the checkpoint."""


class OutputError(ProxyError):
    """The output location cannot be used (exists, inside the input, no space)."""


class CheckFailed(Exception):
    """A verification or comparison found a difference; the CLI exits 1."""


class LogError(ProxyError):
    """A metric log is missing, unreadable, or holds no usable metric."""


class InternalError(RuntimeError):
    """A failure that is neither bad input nor a found difference (a bug, a crashed worker);
    the CLI prints one line and exits 3."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived; the CLI exits 128 + signal after cleaning up.

    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
