"""The span record: one row per finished call, the unit every rlreplay file stores.

Format 2 (written now) keeps the keys as int64 plus a string twin for non-integer values, the
training signals as scalar columns, and token arrays in typed list columns: the JSON payload
holds a ``{"__type__": "tokens", ...}`` placeholder where each array was (see ``rlreplay.format.payload``).
Format 1 files (JSON payloads only, integer keys) are still read: ``upgrade`` gives their rows
the format 2 columns.
"""

from __future__ import annotations

import pyarrow as pa

from rlreplay.errors import FormatError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.keys import FIELDS, KEY_STR, KEYS
from rlreplay.format.kinds import (  # noqa: F401 - the span kinds, read from here too
    KIND_AGENT,
    KIND_LLM,
    KIND_OP,
    KIND_PARSER,
    KIND_SIGNALS,
    KIND_TOOL,
    KIND_TRAJECTORY,
)

FORMAT_VERSION = 2
FORMAT_KEY = b"rlreplay.format_version"

#: Trajectory attributes every span carries (``rlreplay.format.keys.TrajectoryKey``'s fields).
TRAJECTORY_ATTRS = FIELDS

STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_INCOMPLETE = "incomplete"

#: Scalar signal columns (null when absent).
SIGNAL_COLUMNS = ("reward", "advantage", "logprob_diff_mean", "logprob_diff_max", "importance_ratio")
COUNT_COLUMNS = ("num_tokens", "prompt_tokens", "response_tokens")

#: Typed token columns: every array a span's payload held, concatenated per dtype.
TOKEN_COLUMNS = {
    "token_ids": pa.int32(),  # token ids (and other int lists within int32)
    "token_masks": pa.int8(),  # *mask* int lists within int8
    "token_logprobs": pa.float32(),  # float lists exact in float32 (log-probs as servers return them)
}  # other number lists (float64 values, big ints, mixed) stay in the JSON text

SPAN_FIELDS: list[pa.Field] = [
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("span_id", pa.string(), nullable=False),
    pa.field("parent_id", pa.string()),
    pa.field("name", pa.string(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("start_ns", pa.int64(), nullable=False),
    pa.field("end_ns", pa.int64(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("worker", pa.string(), nullable=False),
    pa.field("experiment", pa.string()),
    pa.field("validate", pa.bool_()),
    *(pa.field(k, pa.int64()) for k in KEYS),
    *(pa.field(KEY_STR[k], pa.string()) for k in KEYS),
    *(pa.field(c, pa.float64()) for c in SIGNAL_COLUMNS),
    *(pa.field(c, pa.int64()) for c in COUNT_COLUMNS),
    pa.field("attributes", pa.large_string()),
    pa.field("inputs", pa.large_string()),
    pa.field("output", pa.large_string()),
    *(pa.field(name, pa.large_list(typ)) for name, typ in TOKEN_COLUMNS.items()),
]

SPAN_SCHEMA = pa.schema(SPAN_FIELDS, metadata={FORMAT_KEY: str(FORMAT_VERSION).encode()})

PAYLOAD_COLUMNS = ["attributes", "inputs", "output", *TOKEN_COLUMNS]
#: Columns that are cheap to read: everything but the payloads.
META_COLUMNS = [f.name for f in SPAN_FIELDS if f.name not in PAYLOAD_COLUMNS]

V1_COLUMNS = [
    "trajectory_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "status", "error",
    "step", "sample_index", "rollout_n", "validate", "experiment", "worker", "reward", "num_tokens",
    "attributes", "inputs", "output",
]  # fmt: skip

#: Hive partitioning of the span files: ``spans/step=N/worker=W/``.
PARTITION_SCHEMA = pa.schema([pa.field("step", pa.int64()), pa.field("worker", pa.string())])
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def check_format(metadata: dict[bytes, bytes] | None, source: str) -> int:
    """The file's format version; FormatError when it is missing, malformed or too new."""
    version = (metadata or {}).get(FORMAT_KEY)
    if version is None:
        raise FormatError(f"{source}: not an rlreplay span file (no format version)")
    try:
        number = int(version)
    except ValueError:
        raise FormatError(f"{source}: malformed format version {version[:20]!r}") from None
    if number > FORMAT_VERSION:
        raise FormatError(
            f"{source}: written in format {number}, this rlreplay reads up to {FORMAT_VERSION}; "
            "upgrade rlreplay"
        )
    if number < 1:
        raise FormatError(f"{source}: malformed format version {number}")
    return number


def file_version(schema: pa.Schema, source: str) -> int:
    """The format version of a span file's schema, checking it has that version's columns."""
    version = check_format(schema.metadata, source)
    expected = V1_COLUMNS if version == 1 else SPAN_SCHEMA.names
    if schema.names != expected:
        raise FormatError(f"{source}: not an rlreplay span file (unexpected columns)")
    return version


def upgrade(table: pa.Table, columns: list[str] | None = None) -> pa.Table:
    """Rows of a format 1 file with format 2 columns (``columns`` of them, or all)."""
    names = columns if columns is not None else SPAN_SCHEMA.names
    n = table.num_rows
    arrays = []
    for name in names:
        field = SPAN_SCHEMA.field(name)
        if name in table.column_names:
            arrays.append(
                ops.cast(table[name], field.type) if table[name].type != field.type else table[name]
            )
        elif name in TOKEN_COLUMNS:
            arrays.append(pa.array([[]] * n, type=field.type))
        else:
            arrays.append(pa.nulls(n, type=field.type))
    return pa.table(arrays, schema=pa.schema([SPAN_SCHEMA.field(c) for c in names]))
