"""The errors rlreplay reports to its user: one base class, one subclass per kind, all declared here."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to install an optional extra, from PyPI and from a clone."""
    return f"pip install 'rlreplay[{extra}]' (from a clone: pip install -e '.[{extra}]')"


class RlreplayError(Exception):
    """An error the user can act on: a command prints its message on one line and exits 2."""


class CliError(RlreplayError):
    """Bad input on the command line (an option's value, a missing argument)."""


class KeyTextError(RlreplayError):
    """Trajectory keys written as text (``step=5,sample_index=12``) that cannot be read: an empty
    item, an unknown or repeated key, a key without a value."""


class CommandNotStarted(CliError):
    """The command given to ``record`` could not be started (not found, not executable)."""


class EngineError(RlreplayError):
    """A whole-run question that cannot run where it was asked to: no Ray cluster reachable, Ray
    not installed, workers without rlreplay, a task that failed."""


class SettingError(RlreplayError):
    """An ``RLREPLAY_*`` environment variable whose value cannot be used (one line naming it)."""


class RunError(RlreplayError):
    """Bad input when reading a run: a missing run, an unknown or ambiguous id, a bad filter."""


class SelectionError(RunError):
    """A selection that cannot be applied: bad range, unknown column, bad expression."""


class QueryError(SelectionError):
    """A query DuckDB refused (syntax, unknown column, type): one line naming the problem."""


class SelectorError(SelectionError):
    """A ``show``/``diff`` selector or id that is malformed, or that does not pick exactly one
    trajectory (a selection's error: the selector is a selection)."""


class NothingToCompare(RunError):
    """A selection whose trajectories hold no trainer log-probs, per token or per rollout: nothing
    for ``rlreplay mismatch`` to compare (it says so and how to record them, exit 0)."""

    def __init__(self, why: str, how: str) -> None:
        super().__init__(f"{why}; {how}")
        self.why = why
        self.how = how


class NotFound(RunError):
    """A run or trajectory the web UI does not have (answered with 404)."""


class TokenizerUnavailable(RunError):
    """The tokenizer cannot be loaded on this machine; the message says how to pass a local copy."""


class ReportPathError(RunError):
    """A report path that would overwrite the user's files or write into a recorded run."""


class FormatError(RlreplayError):
    """A file that rlreplay cannot read: foreign, corrupt, or from a newer format."""


class DamagedFileError(FormatError, ValueError):
    """A file whose bytes no longer match the checksums written with it: refused, never read as
    other values (``rlreplay recover`` sets it aside, keeping what still matches). A ValueError
    too, as the errors of the file readers it stands beside."""


class UnsafePathError(FormatError):
    """A path inside a run that resolves outside it (a symlink): rlreplay never writes or deletes there."""


class NotExact(FormatError, ValueError):
    """A recorded value whose JSON form does not give back what was recorded (truncated, hidden by
    redaction, a type nobody rebuilds): a replay does not serve it, and says why."""


class StorageError(RlreplayError):
    """A run location that cannot be used: unreachable store, missing bucket, bad credentials."""


class ReplayError(RlreplayError):
    """A replay that cannot start: no source run, an unknown kind to serve, a selection of nothing."""


class ReplayDivergence(RlreplayError):
    """A call a replay could not serve from the recording (``on_diverge="fail"``): other inputs
    than the recorded op's, a recorded output that is not what the op returned, or a source that
    could not be read."""


class ProxyError(RlreplayError):
    """A proxy that cannot start or a request it cannot take: bad upstream URL, port in use, bad keys."""


class ProxyCallFailed(RlreplayError):
    """A proxied model call that did not end well, as its span records it: the upstream answered an
    error status, its stream broke off, or the client went away before the answer ended."""


class UnknownTrajectory(ProxyError):
    """A call or signals naming a trajectory id or keys the proxy never gave (HTTP 404)."""


class UploadError(RlreplayError):
    """A failure that stops the whole upload (bad credentials, unknown project): one clear line."""


class RequestTimeout(UploadError):
    """A server that did not answer one request within the deadline: the upload stops, resumable."""
