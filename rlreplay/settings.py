"""Every ``RLREPLAY_*`` environment variable, declared once: its name, type, default and meaning.

Code reads a variable through its :class:`Setting` here, never ``os.environ`` by name. ``get()``
raises :class:`~rlreplay.errors.SettingError` (one line naming the variable) on a bad value; the
recording path uses ``get_or_default()``, which says so once on stderr and goes on with the default:
the recorder never raises into training code."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

from rlreplay.errors import SettingError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
#: The variables whose bad value was said already (said once per process).
_warned: set[str] = set()


def _text(value: str) -> str:
    return value


def _flag(value: str) -> bool:
    low = value.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"not one of {', '.join(TRUE + FALSE)}")


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError("not a positive finite number")
    return number


def _not_negative(value: str) -> float:
    number = float(value)
    if not 0 <= number < float("inf"):
        raise ValueError("not a finite number of 0 or more")
    return number


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return value

    return parse


class Setting:
    """One environment variable: ``parse`` turns its text into the value (ValueError when bad); an
    unset or empty variable is ``default``. (A plain class: dataclasses costs 7 ms to import, and
    every recorded process reads settings.)"""

    __slots__ = ("default", "doc", "name", "parse", "type")

    def __init__(
        self, name: str, type: str, default: Any, doc: str, parse: Callable[[str], Any] = _text
    ) -> None:
        self.name, self.type, self.default, self.doc, self.parse = name, type, default, doc, parse

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.type!r}, default={self.default!r})"

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text, None when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value or None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value; a bad one raises SettingError naming the variable."""
        value = self.raw(environ)
        if value is None:
            return self.default
        try:
            return self.parse(value)
        except ValueError as exc:
            raise SettingError(f"${self.name}={value!r}: {exc} (expected {self.type})") from None

    def get_or_default(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value, or the default after one line on stderr when the value is bad."""
        try:
            return self.get(environ)
        except SettingError as exc:
            if self.name not in _warned:
                _warned.add(self.name)
                print(f"rlreplay: warning: {exc}; using {self.default!r}", file=sys.stderr)
            return self.default


# --- recording --------------------------------------------------------------------------------
DIR = Setting("RLREPLAY_DIR", "path or URI", None, "Where a process records (turns recording on).")
EXPERIMENT = Setting("RLREPLAY_EXPERIMENT", "text", None, "The experiment name recorded with the run.")
DISABLE = Setting(
    "RLREPLAY_DISABLE", "flag", False, "Turns recording off even with $RLREPLAY_DIR set.", _flag
)
WORKER = Setting("RLREPLAY_WORKER", "text", None, "This process's worker name in file names.")
POLICY = Setting(
    "RLREPLAY_POLICY", "spill or drop", "spill", "What a full queue does.", _one_of("spill", "drop")
)
MAX_QUEUE_MB = Setting(
    "RLREPLAY_MAX_QUEUE_MB", "megabytes", 32.0, "Most memory queued spans keep alive.", _positive
)
FRAMEWORK = Setting("RLREPLAY_FRAMEWORK", "text", None, "The framework adapter a recorded job uses.")
TOKEN_SIGNALS = Setting(
    "RLREPLAY_TOKEN_SIGNALS", "flag", False, "Keep the trainer's per-token log-probs (verl).", _flag
)
CHAINED_SETUP_HOOK = Setting(
    "RLREPLAY_CHAINED_SETUP_HOOK", "module.function", None, "The job's own Ray setup hook, run after ours."
)
# --- object stores ----------------------------------------------------------------------------
SPOOL = Setting(
    "RLREPLAY_SPOOL", "path", None, "Spool folder of a URI run (default ~/.cache/rlreplay/spool)."
)
CACHE = Setting("RLREPLAY_CACHE", "path", None, "Read cache of URI runs (default ~/.cache/rlreplay/remote).")
PUBLISH_INTERVAL_S = Setting(
    "RLREPLAY_PUBLISH_INTERVAL_S", "seconds", 1.0, "How often sealed files are uploaded.", _positive
)
UPLOAD_TIMEOUT_S = Setting(
    "RLREPLAY_UPLOAD_TIMEOUT_S", "seconds", 30.0, "How long a closing process retries its uploads.", _positive
)
HOST = Setting("RLREPLAY_HOST", "text", None, "This node's name in leases (default: the hostname).")
LEASE_TTL_S = Setting(
    "RLREPLAY_LEASE_TTL_S",
    "seconds",
    60.0,
    "How long another node's lease lives after its heartbeat.",
    _positive,
)
# --- reading ----------------------------------------------------------------------------------
PART_BYTES = Setting(
    "RLREPLAY_PART_BYTES",
    "bytes",
    8 << 20,
    "Bytes of span files one --engine ray task reads (whole steps, or a piece of a larger one).",
    lambda value: max(1, int(value)),
)
# --- uploading to a backend (rlreplay upload) -------------------------------------------------
UPLOAD_BACKOFF_S = Setting(
    "RLREPLAY_UPLOAD_BACKOFF_S",
    "seconds",
    0.5,
    "First wait before `rlreplay upload` retries failed trajectories (doubling each retry, at most 10 s).",
    _not_negative,
)
# --- replay -----------------------------------------------------------------------------------
REPLAY_SOURCE = Setting("RLREPLAY_REPLAY_SOURCE", "path or URI", None, "The run a replay answers from.")
REPLAY_SERVE = Setting("RLREPLAY_REPLAY_SERVE", "kinds", "llm", "Comma-separated span kinds a replay serves.")
REPLAY_ON_DIVERGE = Setting(
    "RLREPLAY_REPLAY_ON_DIVERGE", "live or fail", "live", "What a replay does when a call diverges."
)
REPLAY_SELECT = Setting(
    "RLREPLAY_REPLAY_SELECT", "JSON object", None, "The replay's selection of the source."
)
REPLAY_MATCH_ON = Setting(
    "RLREPLAY_REPLAY_MATCH_ON", "fields", None, "Comma-separated fields a call is matched on."
)

#: Every setting, by variable name.
SETTINGS: dict[str, Setting] = {s.name: s for s in list(globals().values()) if isinstance(s, Setting)}


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise SettingError for the first variable set to a bad value (a command checks them all as it
    starts, so that a bad one is bad input, not a warning halfway)."""
    for setting in SETTINGS.values():
        setting.get(environ)


#: The prefix every variable shares (a job's environment passes them all on to Ray workers).
PREFIX = "RLREPLAY_"
