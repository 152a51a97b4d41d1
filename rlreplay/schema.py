"""The span record: one row per finished call, the unit every rlreplay file stores."""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 1
FORMAT_KEY = b"rlreplay.format_version"

#: Trajectory attributes every span carries (the filters of ``ls``).
TRAJECTORY_ATTRS = ("step", "sample_index", "rollout_n", "validate", "experiment")

#: Span kinds: the trajectory root, an agent loop, a model call, a tool call, a tool-call parser.
KIND_TRAJECTORY = "trajectory"
KIND_AGENT = "agent"
KIND_LLM = "llm"
KIND_TOOL = "tool"
KIND_PARSER = "parser"
KIND_OP = "op"

STATUS_OK = "ok"
STATUS_ERROR = "error"

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
    pa.field("step", pa.int64()),
    pa.field("sample_index", pa.int64()),
    pa.field("rollout_n", pa.int64()),
    pa.field("validate", pa.bool_()),
    pa.field("experiment", pa.string()),
    pa.field("worker", pa.string(), nullable=False),
    pa.field("reward", pa.float64()),
    pa.field("num_tokens", pa.int64()),
    pa.field("attributes", pa.large_string()),
    pa.field("inputs", pa.large_string()),
    pa.field("output", pa.large_string()),
]

SPAN_SCHEMA = pa.schema(SPAN_FIELDS, metadata={FORMAT_KEY: str(FORMAT_VERSION).encode()})

#: Columns that are cheap to read: everything but the JSON payloads.
META_COLUMNS = [f.name for f in SPAN_FIELDS if f.name not in ("attributes", "inputs", "output")]
PAYLOAD_COLUMNS = ["attributes", "inputs", "output"]

#: Hive partitioning of the span files: ``spans/step=N/worker=W/``.
PARTITION_SCHEMA = pa.schema([pa.field("step", pa.int64()), pa.field("worker", pa.string())])
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


class FormatError(Exception):
    """A file that rlreplay cannot read: foreign, corrupt, or from a newer format."""


def check_format(metadata: dict[bytes, bytes] | None, source: str) -> None:
    version = (metadata or {}).get(FORMAT_KEY)
    if version is None:
        raise FormatError(f"{source}: not an rlreplay span file (no format version)")
    if not version.isdigit():
        raise FormatError(f"{source}: unknown format version {version[:20]!r}")
    if int(version) > FORMAT_VERSION:
        raise FormatError(
            f"{source}: written in format {int(version)}, this rlreplay reads up to {FORMAT_VERSION}; "
            "upgrade rlreplay"
        )
