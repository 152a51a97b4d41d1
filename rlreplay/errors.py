"""The errors rlreplay raises for a user's bad input: one base class, one subclass per kind."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to install an optional extra, from PyPI and from a clone."""
    return f"pip install 'rlreplay[{extra}]' (from a clone: pip install -e '.[{extra}]')"


class RlreplayError(Exception):
    """Bad input from the user: a command prints its message on one line and exits 2."""


class RunError(RlreplayError):
    """Bad input when reading a run: a missing run, an unknown or ambiguous id, a bad filter."""


class SelectionError(RunError):
    """A selection that cannot be applied: bad range, unknown column, bad expression."""


class QueryError(SelectionError):
    """A query DuckDB refused (syntax, unknown column, type): one line naming the problem."""


class FormatError(RlreplayError):
    """A file that rlreplay cannot read: foreign, corrupt, or from a newer format."""


class UnsafePathError(FormatError):
    """A path inside a run that resolves outside it (a symlink): rlreplay never writes or deletes there."""


class StorageError(RlreplayError):
    """A run location that cannot be used: unreachable store, missing bucket, bad credentials."""
