"""token2text, offline: decode the token ids a run stored, where text is shown or sent.

verl decodes inside the rollout (so its ``token2text`` defaults to off); rlreplay keeps ids and
decodes later with a tokenizer found on this machine. It never downloads: a tokenizer is a
local directory or ``tokenizer.json``, a package-relative ``pkg:<package>/<subdir>``, or a hub
name already in the Hugging Face cache.

Decoding is exact and batched: texts are the ``tokenizers`` library's ``decode_batch``.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlreplay.errors import TokenizerUnavailable, install_hint
from rlreplay.format.schema import KIND_AGENT, KIND_LLM
from rlreplay.model import Trajectory
from rlreplay.text import conversation
from rlreplay.text.conversation import ConversationFields, llm_output_ids, llm_prompt_ids

PKG_PREFIX = "pkg:"
TOKENIZER_FILE = "tokenizer.json"
HOW_TO = "pass a local copy with --tokenizer /path/to/dir-with-tokenizer.json"
_REPLACEMENT = "\ufffd"


def _unavailable(message: str) -> TokenizerUnavailable:
    return TokenizerUnavailable(" ".join(f"{message}; {HOW_TO}".split()))


# ---- finding a tokenizer ------------------------------------------------------------------------


_PACKAGE_FORM = re.compile(r"^(?:pkg:([A-Za-z_][\w.]*)(?:/(.*))?|([A-Za-z_][\w.]*):(?![/\\])(.*))$")


def package_form(name: str) -> tuple[str, str] | None:
    """(package, subdir) for ``pkg:<package>/<subdir>`` or ``<package>:<subdir>``, else None."""
    match = _PACKAGE_FORM.match(name.strip())
    if match is None:
        return None
    package = match.group(1) or match.group(3)
    return package, (match.group(2) if match.group(1) else match.group(4)) or ""


def _package_dir(name: str, package: str, subdir: str) -> Path:
    """A folder inside an installed package, found without importing the package."""
    top, *inner = package.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise _unavailable(f"tokenizer {name!r}: package {top!r} is not installed")
    if spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        base = Path(spec.origin).parent
    else:
        raise _unavailable(f"tokenizer {name!r}: package {top!r} has no files")
    return base.joinpath(*inner, *(p for p in re.split(r"[/\\]", subdir) if p))


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.endswith(".json")
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _locate(name: str) -> tuple[str, str]:
    """(``"file"``, path to tokenizer.json) or (``"transformers"``, directory or cached hub name)."""
    name = name.strip()
    if not name:
        raise _unavailable("empty tokenizer name")
    path = Path(os.path.expanduser(name))
    in_package = None if path.exists() else package_form(name)
    if in_package is not None:
        path = _package_dir(name, *in_package)
        if not path.exists():
            raise _unavailable(f"tokenizer {name!r}: no folder {path}")
    if path.is_file():
        return "file", str(path.resolve())
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return "file", str((path / TOKENIZER_FILE).resolve())
        if any((path / f).is_file() for f in ("tokenizer_config.json", "vocab.json", "tokenizer.model")):
            return "transformers", str(path.resolve())
        raise _unavailable(f"no {TOKENIZER_FILE} in {path}")
    if _looks_like_path(name):
        raise _unavailable(f"no tokenizer at {name}")
    return _from_hf_cache(name)


def _from_hf_cache(repo_id: str) -> tuple[str, str]:
    """A hub name, from the local Hugging Face cache only (never a download)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise _unavailable(
            f"tokenizer {repo_id!r} is a hub name and huggingface_hub is not installed"
        ) from None
    found: dict[str, Any] = {}
    for filename in (TOKENIZER_FILE, "tokenizer_config.json"):
        try:
            found[filename] = try_to_load_from_cache(repo_id, filename)
        except Exception:  # an invalid repo id, an unreadable cache
            found[filename] = None
    if isinstance(found[TOKENIZER_FILE], str):
        return "file", str(Path(found[TOKENIZER_FILE]).resolve())
    if isinstance(found["tokenizer_config.json"], str):
        return "transformers", repo_id
    raise _unavailable(
        f"tokenizer {repo_id!r} is not a local path and not in the Hugging Face cache "
        "(rlreplay never downloads)"
    )


def tokenizer_source(name_or_path: str) -> str:
    """The file or folder ``Decoder.load(name_or_path)`` reads, found without loading it (raises
    :class:`TokenizerUnavailable` as loading would)."""
    return _locate(name_or_path)[1]


# ---- the decoder --------------------------------------------------------------------------------


class Decoder:
    """Decodes token ids to text with one tokenizer; ``Decoder.load`` caches one per tokenizer."""

    def __init__(self, tokenizer: Any, name: str, source: str, slow: Any = None) -> None:
        self.name = name  # as asked for
        self.source = source  # the file or folder it came from
        self._tok = tokenizer  # a tokenizers.Tokenizer, or None with ``slow``
        self._slow = slow  # a transformers tokenizer without a Rust backend
        self._byte_level = tokenizer is not None and type(tokenizer.decoder).__name__ == "ByteLevel"
        self._ascii: dict[bool, Any] = {}  # skip_special_tokens → printable-ASCII ids (numpy)

    def __repr__(self) -> str:
        return f"Decoder({self.name!r}, source={self.source!r})"

    @classmethod
    def load(cls, name_or_path: str) -> Decoder:
        """The decoder for a local path, ``pkg:<package>/<subdir>`` or cached hub name (loaded once)."""
        with _CACHE_LOCK:
            hit = _BY_NAME.get(name_or_path)
        if hit is not None:
            return hit
        kind, where = _locate(name_or_path)
        with _CACHE_LOCK:
            decoder = _BY_SOURCE.get(where)
            if decoder is None:
                load = _load_file if kind == "file" else _load_transformers
                decoder = load(name_or_path, where)
                _BY_SOURCE[where] = decoder
            _BY_NAME[name_or_path] = decoder
        return decoder

    @property
    def concatenative(self) -> bool:
        """True when decode(a + b) == decode(a) + decode(b) wherever a ends a character (byte-level BPE)."""
        return self._byte_level

    def printable_ascii(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[bool]:
        """Per id list: True when its text is sure to be printable ASCII (tabs and line breaks
        allowed), known without decoding it: on a byte-level tokenizer, every id of it decodes
        alone to such text. False: not known (decode it)."""
        import numpy as np

        table = self._ascii_table(skip_special_tokens)
        if table is None:
            return [False] * len(seqs)
        out = []
        for seq in seqs:
            ids = np.asarray(seq, dtype=np.int64)
            out.append(bool(not len(ids) or (ids.min() >= 0 and ids.max() < len(table) and table[ids].all())))
        return out

    def _ascii_table(self, skip_special_tokens: bool) -> Any:
        """Per id of the vocabulary: it decodes alone to printable ASCII (None: not byte-level)."""
        if not self._byte_level:
            return None
        key = bool(skip_special_tokens)
        table = self._ascii.get(key)
        if table is None:
            import numpy as np

            size = self._tok.get_vocab_size(with_added_tokens=True)
            texts = self._tok.decode_batch([[i] for i in range(size)], skip_special_tokens=key)
            plain = str.maketrans("\t\n\r", "   ")
            table = np.fromiter((t.isascii() and t.translate(plain).isprintable() for t in texts), bool, size)
            self._ascii[key] = table
        return table

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_many([ids], skip_special_tokens)[0]

    def decode_many(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """Texts of many id lists in one call, exactly as the tokenizer's own ``decode`` gives them."""
        if not len(seqs):
            return []
        if self._slow is not None:
            texts = self._slow.batch_decode(list(seqs), skip_special_tokens=skip_special_tokens)
            return [str(t) for t in texts]
        return self._rust_many(seqs, skip_special_tokens)

    def _rust_many(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        batch = seqs if isinstance(seqs, list) else list(seqs)
        try:
            return self._tok.decode_batch(batch, skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"token ids must be non-negative integers: {exc}") from None


def _load_file(name: str, path: str) -> Decoder:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise _unavailable(f"the tokenizers package is not installed ({install_hint('text')})") from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:
        raise _unavailable(f"cannot read tokenizer {path}: {' '.join(str(exc).split())[:200]}") from None
    return Decoder(tok, name, path)


def _load_transformers(name: str, where: str) -> Decoder:
    """A folder without tokenizer.json (or a cached hub name): transformers, local files only."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise _unavailable(
            f"tokenizer {name!r} has no {TOKENIZER_FILE} and transformers is not installed"
        ) from None
    try:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as exc:
        raise _unavailable(f"cannot load tokenizer {name!r}: {' '.join(str(exc).split())[:200]}") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):
        return Decoder(backend, name, where)
    return Decoder(None, name, where, slow=tok)


_CACHE_LOCK = threading.Lock()
_BY_SOURCE: dict[str, Decoder] = {}
_BY_NAME: dict[str, Decoder] = {}


#: Manifest keys naming the run's tokenizer: a hub name or path, and a copy that ships with a
#: package (``<package>:<subdir>`` or ``pkg:<package>/<subdir>``) so that a run decodes offline.
MANIFEST_KEYS = ("tokenizer", "tokenizer_files")
#: Manifest key listing the tokenizer files ``record`` copied into the run (its top folder).
SNAPSHOT_KEY = "tokenizer_snapshot"
#: The files of a tokenizer a run keeps: decoding, special tokens and the chat template (in
#: tokenizer_config.json or a file of its own). A few MB, once per run.
SNAPSHOT_FILES = (
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
#: What a tokenizer without ``tokenizer.json`` decodes with (kept only then).
SNAPSHOT_FALLBACK = ("vocab.json", "merges.txt", "tokenizer.model")
#: A file larger than this is not copied (no tokenizer file is near it).
SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024


def tokenizer_files(name: str) -> dict[str, Path]:
    """The files of tokenizer ``name`` (a folder, a ``tokenizer.json``, ``pkg:...`` or a cached hub
    name) found on this machine, by file name: what ``snapshot_tokenizer`` copies. Raises
    ``TokenizerUnavailable`` when there is no such tokenizer here."""
    kind, where = _locate(name)
    if kind == "transformers" and not Path(where).is_dir():  # a hub name in the local cache
        from huggingface_hub import try_to_load_from_cache

        found = {}
        for file in (*SNAPSHOT_FILES, *SNAPSHOT_FALLBACK):
            try:
                cached = try_to_load_from_cache(where, file)
            except Exception:  # an invalid repo id, an unreadable cache
                cached = None
            if isinstance(cached, str):
                found[file] = Path(cached)
    else:
        path = Path(where)
        if kind == "file" and path.name != TOKENIZER_FILE:  # a lone tokenizer file: only itself
            return {TOKENIZER_FILE: path}
        folder = path.parent if kind == "file" else path
        found = {f: folder / f for f in (*SNAPSHOT_FILES, *SNAPSHOT_FALLBACK) if (folder / f).is_file()}
    if TOKENIZER_FILE in found:
        found = {f: p for f, p in found.items() if f not in SNAPSHOT_FALLBACK}
    return found


def snapshot_tokenizer(name: str, run_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the files of tokenizer ``name`` into the top folder of ``run_dir`` (byte for byte, each
    written whole), so that the run decodes and renders its chat template on any machine
    (``AutoTokenizer.from_pretrained(run_dir)``). Returns the names copied, sorted; raises
    ``TokenizerUnavailable`` when the tokenizer is not on this machine, ``OSError`` when a copy fails."""
    import shutil

    from rlreplay.format.manifest import safe_run_path

    copied = []
    for file, source in tokenizer_files(name).items():
        if source.stat().st_size > SNAPSHOT_MAX_BYTES:
            continue
        target = safe_run_path(run_dir, file)
        tmp = target.with_name(f".{file}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        copied.append(file)
    return sorted(copied)


def _snapshot_dir(run: Any, manifest: dict[str, Any]) -> str | None:
    """The run's own folder when it holds the tokenizer files ``record`` copied into it."""
    kept = manifest.get(SNAPSHOT_KEY)
    path = getattr(run, "path", None)
    if not isinstance(kept, list) or path is None:
        return None
    files = [f for f in kept if isinstance(f, str) and f in (*SNAPSHOT_FILES, *SNAPSHOT_FALLBACK)]
    if files and all((Path(path) / f).is_file() for f in files):
        return str(path)
    return None


def resolve_tokenizer(run: Any, override: str | None) -> str | None:
    """The tokenizer to use: ``override``, else the copy ``record`` kept in the run, else the one
    the run's manifest names (or None).

    Of the manifest's ``tokenizer`` and ``tokenizer_files``, the first found on this machine wins
    (a local copy before a hub name); when neither is, ``tokenizer``, so that the error names it.
    A relative path in the manifest is taken relative to the run directory when it exists there.
    """
    if override:
        return override
    manifest = getattr(run, "manifest", None) or {}
    snapshot = _snapshot_dir(run, manifest)
    if snapshot is not None:  # the files that rendered and decoded the run, kept with it
        return snapshot
    names: list[str] = []
    for key in MANIFEST_KEYS:
        value = manifest.get(key)
        if isinstance(value, str) and value.strip():
            value = value.strip()
            inside = Path(run.path) / value if not os.path.isabs(value) else None
            names.append(str(inside) if inside is not None and inside.exists() else value)
    if len(names) > 1:
        local = [n for n in names if Path(os.path.expanduser(n)).exists() or package_form(n)]
        hub = [n for n in names if n not in local]
        for name in [*local, *hub]:
            try:
                _locate(name)
            except TokenizerUnavailable:
                continue
            return name
    return names[0] if names else None


# ---- decoding trajectories ----------------------------------------------------------------------


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and (not value or (type(value[0]) is int and type(value[-1]) is int)):
        return value
    return None


def _fields(adapter: Any = None) -> Any:
    """The adapter's conversation fields (an adapter without them: the generic ones)."""
    return getattr(adapter, "fields", None) or ConversationFields()


def _llm_prompt_ids(inputs: Any, fields: Any = None) -> list[int] | None:
    found = llm_prompt_ids(inputs, fields or _fields())
    return found if _ids(found) is not None else None


def _llm_output_ids(output: Any, fields: Any = None) -> list[int] | None:
    if not isinstance(output, dict):
        return None
    found = llm_output_ids(output, fields or _fields())
    return found if _ids(found) is not None else None


class _Plan:
    """Every text wanted for a set of trajectories, and where each goes, decoded in one batch.

    A wanted text whose ids are consecutive turns of its trajectory's conversation (an llm
    prompt is the context so far; the agent's prompt and response are turns too) is assembled
    from the turns' texts instead of decoded again, when the decoder allows it.
    """

    def __init__(self, decoder: Decoder, skip_special_tokens: bool) -> None:
        self.decoder = decoder
        self.skip = skip_special_tokens
        self.seqs: list[list[int]] = []
        self.slots: dict[tuple[int, ...], int] = {}  # dedupe of identical turn ids
        self.direct: list[tuple[dict[str, Any], str, int]] = []  # (target, key, seq index)
        self.joined: list[tuple[dict[str, Any], str, list[int], list[int]]] = []  # + turn indexes, ids

    def add_seq(self, ids: list[int], dedupe: bool = False) -> int:
        if dedupe:
            key = tuple(ids)
            slot = self.slots.get(key)
            if slot is not None:
                return slot
            self.slots[key] = len(self.seqs)
        self.seqs.append(ids)
        return len(self.seqs) - 1

    def want(
        self, target: dict[str, Any], key: str, ids: list[int], segments: _Segments | None, first: int | None
    ) -> None:
        """Text for ``ids`` into ``target[key]``; ``first``: the turn these ids should begin with."""
        parts = segments.cover(ids, first) if segments is not None and first is not None else None
        if parts is not None:
            self.joined.append((target, key, [segments.slots[i] for i in parts], ids))
        else:
            self.direct.append((target, key, self.add_seq(ids)))

    def run(self) -> list[str]:
        texts = self.decoder.decode_many(self.seqs, self.skip)
        for target, key, slot in self.direct:
            target[key] = texts[slot]
        retry: list[tuple[dict[str, Any], str, list[int]]] = []
        for target, key, slots, ids in self.joined:
            pieces = [texts[s] for s in slots if texts[s]]
            if all(
                not a.endswith(_REPLACEMENT) and not b.startswith(_REPLACEMENT)
                for a, b in itertools.pairwise(pieces)
            ):
                target[key] = "".join(pieces)
            else:  # a turn boundary splits a character: decode the whole (rare)
                retry.append((target, key, ids))
        if retry:
            for (target, key, _), text in zip(
                retry, self.decoder.decode_many([r[2] for r in retry], self.skip)
            ):
                target[key] = text
        return texts


class _Segments:
    """A trajectory's turns laid end to end: the full context, and where each turn starts in it."""

    def __init__(self, turns: list[Any], slots: list[int]) -> None:
        self.slots = slots
        self.full: list[int] = []
        self.starts: list[int] = []
        for turn in turns:
            self.starts.append(len(self.full))
            self.full += turn.token_ids
        self.ends = [*self.starts[1:], len(self.full)]
        self.by_span = {t.span_id: i for i, t in enumerate(turns) if t.span_id}

    def cover(self, ids: list[int], first: int) -> range | None:
        """The turns ``first``, ``first + 1``, ... whose ids joined are exactly ``ids``, if any."""
        if not ids or first >= len(self.starts):
            return None
        start = self.starts[first]
        end = start + len(ids)
        last = bisect.bisect_left(self.ends, end, lo=first)
        if last < len(self.ends) and self.ends[last] == end and self.full[start:end] == ids:
            return range(first, last + 1)
        return None


def add_text(
    trajectories: list[Trajectory], decoder: Decoder, skip_special_tokens: bool = False, adapter: Any = None
) -> None:
    """Add decoded text to trajectories in place, with one batched decode for all of them.

    Which fields hold token ids, and how a trajectory splits into turns, is the framework
    adapter's answer (``adapter``, default: generic; ``rlreplay.adapters.registry.adapter_for_run``).

    ``llm`` spans get ``inputs["prompt_text"]`` and ``output["response_text"]`` (like verl's
    token2text); ``agent`` spans get ``output["prompt_text"]``, ``output["response_text"]`` and
    ``output["conversation"]``: ``[{"role", "text", "tool_calls"}, ...]``, one per turn.
    """
    fields = _fields(adapter)
    plan = _Plan(decoder, skip_special_tokens)
    conversations: list[tuple[dict[str, Any], list[Any], list[int]]] = []
    for traj in trajectories:
        agent = conversation.conversation_span(traj, fields)
        if agent is not None and not isinstance(agent.output, dict):
            agent = None
        segments = None
        if agent is not None:
            turns = conversation.turns(traj, adapter=adapter)
            slots = [plan.add_seq(t.token_ids, dedupe=True) for t in turns]
            conversations.append((agent.output, turns, slots))
            if decoder.concatenative and turns:
                segments = _Segments(turns, slots)
        for span in traj.spans:
            if span.kind == KIND_LLM:
                prompt = _llm_prompt_ids(span.inputs, fields)
                if prompt is not None:  # the context so far: turns 0, 1, ...
                    plan.want(span.inputs, "prompt_text", prompt, segments, 0)
                response = _llm_output_ids(span.output, fields)
                if response is not None:  # the assistant turn this call produced
                    first = segments.by_span.get(span.span_id) if segments is not None else None
                    plan.want(span.output, "response_text", response, segments, first)
            elif span.kind == KIND_AGENT and isinstance(span.output, dict):
                own = segments if agent is not None and span.output is agent.output else None
                prompt = _ids(conversation.first_field(span.output, fields.prompt))
                if prompt is not None:
                    plan.want(span.output, "prompt_text", prompt, own, 0)
                response = _ids(conversation.first_field(span.output, fields.response))
                if response is not None:
                    plan.want(span.output, "response_text", response, own, 1)
    texts = plan.run()
    for target, turns, slots in conversations:
        target["conversation"] = [
            {"role": t.role, "text": texts[s], "tool_calls": t.tool_calls} for t, s in zip(turns, slots)
        ]
