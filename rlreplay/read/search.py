"""Text search: the trajectories whose decoded response or tool output matches a regular expression.

What is searched, per trajectory: the text of its conversation after the prompt (assistant and
tool turns, as its framework adapter splits them, decoded with special tokens left out), one turn
a line, then what its tool calls returned (their own output text). The prompt is not searched: it
is the dataset's, the same for every rollout of a sample. Patterns are RE2 regular expressions
(DuckDB's ``regexp_matches`` speaks the same), matched anywhere in the text, ``^`` and ``$`` at the
start and end of each line (as grep does); ``(?i)`` makes one case-insensitive, and a plain word
matches itself.

Decoding is most of the work, so the texts of a step are kept in the user's cache
(``$XDG_CACHE_HOME/rlreplay/text/``), one file per step and tokenizer, named by what they were
made from (the step's sealed shards, their sizes and times, the tokenizer file, the adapter): a
later search reads them instead of decoding again, and a changed shard or tokenizer makes a new
one. A step with live files is decoded every time. The run directory is never written.

A search reads and searches the kept texts of its steps in parallel (threads: Parquet reads and
the regex kernel leave the interpreter lock), then decodes the steps that have none, one after
another.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlreplay.adapters.registry import MANIFEST_KEY
from rlreplay.errors import SelectionError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_TOOL
from rlreplay.read.scan import step_calls, step_rows

#: The span kinds that hold what is searched: model calls (the turns after the prompt) and tools; the
#: agent span only for a trajectory without model calls (its whole response).
SEARCHED_KINDS = (KIND_LLM, KIND_TOOL)
AGENT_KINDS = (KIND_AGENT, KIND_TOOL)
#: Flags every pattern is matched with: ``^`` and ``$`` at each line's start and end.
FLAGS = "(?m)"
#: Changes when what a cached text holds changes (older files are then not used).
TEXT_VERSION = "1"
TEXT_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.large_string())])
#: At most this many steps' kept texts are read and searched at once (by default one a CPU).
MAX_THREADS = 16


def check_pattern(pattern: str) -> None:
    """Raise :class:`SelectionError` when ``pattern`` is not an RE2 regular expression."""
    if not pattern:
        raise SelectionError("--grep: empty pattern")
    try:
        ops.match_substring_regex(pa.array([""], pa.large_string()), FLAGS + pattern)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        why = " ".join(str(exc).split()).removeprefix("Invalid: ")
        raise SelectionError(f"--grep {pattern!r} is not a regular expression (RE2 syntax): {why}") from None


def matching(table: pa.Table, pattern: str, texts: TextSearch) -> pa.Table:
    """The rows of a listing whose searched text matches ``pattern``, in their order."""
    check_pattern(pattern)
    if not table.num_rows:
        return table
    return ops.filter(table, texts.matches(table, FLAGS + pattern))


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlreplay" / "text"


def _stamp(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return [0, 0]
    return [st.st_size, st.st_mtime_ns]


class TextSearch:
    """The searched texts of one run's trajectories, decoded on demand and kept (in this object, and
    per step in the user's cache). ``decoder``: a decoder, or the tokenizer name ``Decoder.load``
    takes (loaded only when something is to be decoded); ``threads``: how many steps' kept texts
    are read and searched at once (default: one a CPU, ``MAX_THREADS`` at most)."""

    def __init__(
        self, run: Any, decoder: Any, adapter: Any = None, cache: bool = True, threads: int | None = None
    ) -> None:
        from rlreplay.text.token2text import tokenizer_source

        self.run = run
        self._decoder = decoder
        if isinstance(decoder, str):
            self.source = tokenizer_source(decoder)
        else:
            self.source = str(getattr(decoder, "source", getattr(decoder, "name", "")))
        self._adapter = adapter
        self.cache = cache
        self.threads = threads or min(os.cpu_count() or 1, MAX_THREADS)
        self._steps: dict[Any, tuple[tuple[Any, ...], pa.Table]] = {}  # step -> (made from, id/text)
        self._run_key: str | None = None

    @classmethod
    def for_run(cls, run: Any, tokenizer: str | None = None) -> TextSearch:
        """The search of ``run`` with its tokenizer (or ``tokenizer``); raises a one-line error when
        none is known or it is not on this machine."""
        from rlreplay.text.token2text import resolve_tokenizer

        name = resolve_tokenizer(run, tokenizer)
        if name is None:
            raise SelectionError(
                "--grep searches decoded text and no tokenizer is known for this run; "
                "pass --tokenizer /path/to/dir-with-tokenizer.json"
            )
        return cls(run, name)

    @property
    def adapter(self) -> Any:
        """The run's framework adapter (looked up when first needed: decoding, not reading kept texts)."""
        if self._adapter is None:
            from rlreplay.adapters.registry import adapter_for_run

            self._adapter = adapter_for_run(self.run)
        return self._adapter

    @property
    def decoder(self) -> Any:
        if isinstance(self._decoder, str):
            from rlreplay.text.token2text import Decoder

            self._decoder = Decoder.load(self._decoder)
        return self._decoder

    def matches(self, listing: pa.Table, regex: str) -> pa.Array:
        """Whether the searched text of each row of ``listing`` matches ``regex`` (RE2, flags
        included; a row without text is searched as ""), in its order. The steps whose texts are
        kept are read and searched in parallel; the others are decoded after, one at a time."""
        import numpy as np

        ids = listing["id"]
        empty = ops.match_substring_regex(pa.array([""], pa.large_string()), regex)[0].as_py()

        def search(step: Any, rows: Any, decode: bool) -> Any:
            wanted = ops.take(ids, rows).combine_chunks()
            texts = self._step_texts(step, wanted, decode)
            if texts is None:
                return None  # some texts are not kept: decoded later
            found = ops.match_substring_regex(texts["text"], regex)
            hit = ops.fill_null(ops.take(found, ops.index_in(wanted, texts["id"])), empty)
            return hit.to_numpy(zero_copy_only=False)

        groups = step_rows(listing)
        threads = min(len(groups), self.threads)
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="rlreplay-search") as pool:
                hits = list(pool.map(lambda group: search(*group, decode=False), groups))
        else:
            hits = [None] * len(groups)
        mask = np.zeros(listing.num_rows, np.bool_)
        for (step, rows), hit in zip(groups, hits):
            mask[rows] = search(step, rows, decode=True) if hit is None else hit
        return pa.array(mask)

    def _step_texts(self, step: Any, ids: Sequence[str] | pa.Array, decode: bool = True) -> pa.Table | None:
        """The texts (``id``, ``text``) of at least ``ids``, all of one step: those kept when they
        were made from the step's files as they are, the others decoded now (and kept); None when
        some are not kept and not ``decode``."""
        key = self._step_key(step)
        kept = self._steps.get(step)
        if key is None:
            table = TEXT_SCHEMA.empty_table()
        elif kept is not None and kept[0] == key:
            table = kept[1]
        else:
            table = self._cached(step, key)
        wanted = ids if isinstance(ids, pa.Array) else pa.array(list(ids), pa.string())
        missing = ops.filter(wanted, ops.invert(ops.is_in(wanted, table["id"]))).to_pylist()
        if missing and not decode:
            if key is not None:
                self._steps[step] = (key, table)  # read once: the decoding call takes it from here
            return None
        if missing:
            new = self._decode(step, missing)
            table = pa.concat_tables([table, pa.table(new, schema=TEXT_SCHEMA)])
            if key is not None:
                self._save(step, key, table)
        if key is not None:
            self._steps[step] = (key, table)
        return table

    # ---- the cache ----------------------------------------------------------------------------

    def _step_key(self, step: Any) -> tuple[Any, ...] | None:
        """What a step's texts are made from (None: not kept: live files, or a step not an int)."""
        if type(step) is not int or not self.cache:
            return None
        sealed, live = self.run.span_files(step)
        if live:
            return None
        shards = tuple((os.path.relpath(p, self.run.path), *self.run.store.stamp(p)) for p in sorted(sealed))
        framework = (getattr(self.run, "manifest", None) or {}).get(MANIFEST_KEY) or "generic"
        return (TEXT_VERSION, str(framework), self.source, *_stamp(self.source), shards)

    def _file(self, step: int, key: tuple[Any, ...]) -> Path:
        if self._run_key is None:
            where = self.run.address if self.run.store.uri else str(Path(self.run.path).resolve())
            self._run_key = hashlib.sha256(where.encode()).hexdigest()[:24]
        made_from = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        return _cache_root() / self._run_key / f"step={step}" / f"{made_from}.parquet"

    def _cached(self, step: int, key: tuple[Any, ...]) -> pa.Table:
        """The step's kept texts (none when there are none, or they cannot be read or do not match
        their checksums: then they are decoded again)."""
        from rlreplay.format import checksums

        try:
            return ops.cast_table(checksums.read_table(self._file(step, key)), TEXT_SCHEMA)
        except (OSError, pa.ArrowException, ValueError):
            return TEXT_SCHEMA.empty_table()

    def _save(self, step: int, key: tuple[Any, ...], table: pa.Table) -> None:
        """Keep the step's texts, replacing its older file; a cache that cannot be written is
        passed over."""
        from rlreplay.format import checksums

        path = self._file(step, key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            checksums.write_table(table, tmp, compression="zstd")
            os.replace(tmp, path)
            for old in path.parent.glob("*.parquet"):
                if old != path:
                    old.unlink(missing_ok=True)
        except (OSError, pa.ArrowException):
            tmp.unlink(missing_ok=True)

    # ---- decoding -----------------------------------------------------------------------------

    def _decode(self, step: Any, ids: Sequence[str]) -> dict[str, list[str]]:
        """The searched texts of ``ids`` (all of one step), decoded in one batch, as columns."""
        parts: list[list[int]] = []
        owners: list[str] = []
        tools: dict[str, list[str]] = {}
        read = self._read(step, ids, SEARCHED_KINDS)
        without_calls = [t.id for t in read if not t.by_kind(KIND_LLM)]
        if without_calls:  # no model calls recorded: the agent span's response instead
            again = {t.id: t for t in self._read(step, without_calls, AGENT_KINDS)}
            read = [again.get(t.id, t) for t in read]
        for traj in read:
            for piece in self._pieces(traj):
                parts.append(list(piece))
                owners.append(traj.id)
            tools[traj.id] = self._tool_texts(traj)
        decoded = self.decoder.decode_many(parts, skip_special_tokens=True) if parts else []
        lines: dict[str, list[str]] = {i: [] for i in ids}
        for owner, text in zip(owners, decoded):
            lines[owner].append(text)
        return {"id": list(ids), "text": ["\n".join([*lines[i], *tools.get(i, [])]) for i in ids]}

    def _pieces(self, traj: Any) -> list[Any]:
        """The token ids searched: the turns after the prompt (from the model calls), else the
        agent's whole response."""
        from rlreplay.text.conversation import ConversationFields, conversation_span, first_field

        found = [t.token_ids for t in self.adapter.turns(traj) if t.role != "prompt" and len(t.token_ids)]
        if found:
            return found
        fields = getattr(self.adapter, "fields", None) or ConversationFields()
        agent = conversation_span(traj, fields)
        output = agent.output if agent is not None and isinstance(agent.output, dict) else {}
        response = first_field(output, fields.response)
        return [response] if isinstance(response, list) and response and type(response[0]) is int else []

    def _tool_texts(self, traj: Any) -> list[str]:
        text_of = getattr(self.adapter, "tool_output_text", None)
        if text_of is None:
            return []
        found = (text_of(s.output) for s in sorted(traj.by_kind(KIND_TOOL), key=lambda s: s.start_ns))
        return [t for t in found if t]

    def _read(self, step: Any, ids: Sequence[str], kinds: Sequence[str]) -> list[Any]:
        """The trajectories ``ids`` of ``step`` with their spans of ``kinds``."""
        if type(step) is not int:
            return self.run.load(list(ids), kinds=kinds)
        warn = lambda message: self.run.warn(f"step {step}: {message}")  # noqa: E731
        calls = step_calls(self.run, step, ids, kinds, warn)
        out = []
        for k in range(len(ids)):
            traj = calls.trajectory(k)
            if traj is not None:
                for span in traj.spans:  # the id arrays read as numpy: as lists, as turns want them
                    span.inputs, span.output = _lists(span.inputs), _lists(span.output)
                out.append(traj)
        return out


def _lists(value: Any) -> Any:
    """``value`` with its numpy arrays (token ids read in bulk) as lists."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_lists(v) for v in value] if value and isinstance(value[0], (dict, list)) else value
    return value.tolist() if hasattr(value, "tolist") and hasattr(value, "dtype") else value
