"""Checks over each trajectory's spans: re-tokenized turns, repetition loops, garbled text,
truncated or empty model calls, failing tools and parsers."""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Iterator
from typing import Any

from rlreplay.audit.finding import (
    ERROR,
    LEVEL_TRAJECTORY,
    OVER_TRAJECTORIES,
    WARNING,
    Check,
    Context,
    Finding,
    finding_about,
)
from rlreplay.format.kinds import KIND_LLM, KIND_PARSER, KIND_TOOL


def _finding(check: str, traj: Any, severity: str, detail: str, **kw: Any) -> Finding:
    return finding_about(check, traj.id, traj.key, severity, detail, **kw)


def _calls(traj: Any, kind: str) -> list[Any]:
    return sorted((s for s in traj.spans if s.kind == kind), key=lambda s: (s.start_ns, s.end_ns))


def retokenization(traj: Any, ctx: Context) -> Iterator[Finding]:
    import numpy as np

    calls = [ctx.adapter.call_ids(s) for s in _calls(traj, KIND_LLM)]
    for turn in range(1, len(calls)):
        (prompt, response), (following, _) = calls[turn - 1], calls[turn]
        if prompt is None or response is None or following is None:
            continue
        expected = np.concatenate((np.asarray(prompt, np.int64), np.asarray(response, np.int64)))
        following = np.asarray(following, np.int64)
        n = min(len(expected), len(following))
        differ = np.flatnonzero(expected[:n] != following[:n])
        position = int(differ[0]) if len(differ) else None
        if position is None and len(following) < len(expected):
            position = len(following)
        if position is not None:
            changed = len(expected) - position
            yield _finding(
                "retokenization",
                traj,
                ERROR,
                f"model call {turn}'s prompt differs from call {turn - 1}'s prompt + response at token "
                f"{position} (of {len(expected)}; {changed} sampled tokens re-tokenized)",
                turn=turn,
                position=position,
                score=changed,
            )


def _loop(ids: Any, max_ngram: int) -> tuple[int, int, int] | None:
    """(n-gram length, repeats, start) of the longest stretch of ``ids`` repeating one n-gram
    (the shortest n-gram among equally long stretches; the first such stretch)."""
    import numpy as np

    a = np.asarray(ids, dtype=np.int64)
    size = len(a)
    top = min(max_ngram, size // 2)
    if top < 1:
        return None
    # row n - 1, column j: a[j + n] == a[j]; a False column after each row ends its runs
    same = np.zeros((top, size + 1), dtype=bool)
    for n in range(1, top + 1):
        np.equal(a[n:], a[:-n], out=same[n - 1, : size - n])
    edges = np.diff(np.r_[np.int8(0), same.ravel().view(np.int8)])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return None
    rows = starts // (size + 1)
    lengths = ends - starts
    # per n-gram length: its longest run, the first of those
    order = np.lexsort((starts, -lengths, rows))
    first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
    covered = lengths[first] + rows[first] + 1
    n = rows[first] + 1
    fits = covered >= 2 * n
    if not fits.any():
        return None
    pick = first[fits][int(np.argmax(covered[fits]))]  # argmax: the shortest n-gram among ties
    n_best = int(rows[pick]) + 1
    return n_best, int(lengths[pick] + n_best) // n_best, int(starts[pick] - rows[pick] * (size + 1))


def _may_loop(ids: Any, max_ngram: int, least: int) -> bool:
    """False when no n-gram of up to ``max_ngram`` tokens repeats over a stretch of ``least`` + n
    tokens or more (``_loop`` would find no such stretch): one pass over all n-gram lengths."""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    a = np.asarray(ids, dtype=np.int64)
    if max_ngram < 1 or least > len(a):
        return False
    # distinct negative values after the end: no position past it compares equal
    padded = np.concatenate((a, -np.arange(1, max_ngram + 1, dtype=np.int64)))
    window = as_strided(padded, shape=(len(a), max_ngram + 1), strides=(8, 8), writeable=False)
    same = window[:, 1:] == window[:, :1]  # [j, n - 1]: a[j + n] == a[j]
    # a stretch of ``least`` equal pairs holds an aligned block of half as many
    block = (least + 1) // 2
    whole = len(a) // block * block
    if not same[:whole].reshape(-1, block, max_ngram).all(axis=1).any():
        return False
    runs = np.zeros((len(a) + 1, max_ngram), dtype=np.int32)
    np.cumsum(same, axis=0, out=runs[1:])
    return bool(((runs[least:] - runs[:-least]) == least).any())


def _least_run(max_ngram: int, min_repeats: float, min_tokens: float) -> int:
    """The fewest equal pairs (a[j + n] == a[j] in a row) a finding's n-gram loop spans."""
    import math

    repeats, tokens = math.ceil(min_repeats), math.ceil(min_tokens)
    return max(1, min((max(tokens, repeats * n, 2 * n) - n for n in range(1, max_ngram + 1)), default=1))


def repetition(traj: Any, ctx: Context) -> Iterator[Finding]:
    most = int(ctx["repetition_max_ngram"])
    for turn, span in enumerate(_calls(traj, KIND_LLM)):
        _, response = ctx.adapter.call_ids(span)
        if response is None or not len(response) or len(response) < ctx["repetition_min_tokens"]:
            continue
        # an n-gram repeated at least twice fits in the response: longer ones need no looking for
        max_ngram = min(most, len(response) // 2)
        least = _least_run(max_ngram, ctx["repetition_min_repeats"], ctx["repetition_min_tokens"])
        if not _may_loop(response, max_ngram, least):
            continue
        found = _loop(response, max_ngram)
        if found is None:
            continue
        n, repeats, start = found
        if repeats >= ctx["repetition_min_repeats"] and n * repeats >= ctx["repetition_min_tokens"]:
            yield _finding(
                "repetition",
                traj,
                WARNING,
                f"model call {turn} repeats a {n}-token n-gram {repeats} times from token {start} "
                f"(of {len(response)})",
                turn=turn,
                position=start,
                score=n * repeats / len(response),
            )


#: letters of these scripts are counted apart; any other letter counts as its own script
_SCRIPTS = (
    "LATIN",
    "CJK",
    "HIRAGANA",
    "KATAKANA",
    "HANGUL",
    "CYRILLIC",
    "GREEK",
    "ARABIC",
    "HEBREW",
    "DEVANAGARI",
    "THAI",
    "ARMENIAN",
    "GEORGIAN",
    "ETHIOPIC",
    "TAMIL",
    "BENGALI",
)
_SAME = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK"}


def garbled_reasons(text: str, ctx: Context) -> list[str]:
    """Why a decoded text looks garbled: replacement or control characters, or too many scripts."""
    from collections import Counter

    reasons = []
    counts = Counter(text)  # each distinct character looked at once
    bad = counts.get("\ufffd", 0)
    if bad >= ctx["garbled_replacements"]:
        reasons.append(f"{bad} replacement characters")
    control = 0
    scripts: dict[str, int] = {}
    for c, count in counts.items():
        kind = _char_kind(c)
        if kind is _CONTROL:
            control += count
        elif kind is not None:
            scripts[kind] = scripts.get(kind, 0) + count
    if control >= ctx["garbled_controls"]:
        reasons.append(f"{control} control characters")
    mixed = sorted(s for s, count in scripts.items() if count >= ctx["garbled_script_letters"])
    if len(mixed) >= ctx["garbled_scripts"]:
        reasons.append(f"{len(mixed)} scripts mixed ({', '.join(s.lower() for s in mixed)})")
    return reasons


_CONTROL = "control"


@functools.lru_cache(maxsize=1 << 16)
def _char_kind(c: str) -> str | None:
    """``_CONTROL`` for a control character, a letter's script, else None."""
    if unicodedata.category(c) in ("Cc", "Cs", "Co") and c not in "\n\r\t":
        return _CONTROL
    if c.isalpha():
        word = unicodedata.name(c, "UNKNOWN").split(" ")[0]
        return _SAME.get(word, word) if word in _SCRIPTS else word
    return None


def garbled(traj: Any, ctx: Context) -> Iterator[Finding]:
    spans = _calls(traj, KIND_LLM)
    ids = [r if (r := ctx.adapter.call_ids(s)[1]) is not None else [] for s in spans]
    if not any(len(i) for i in ids):
        return
    # a text of printable ASCII alone has no replacement or control character and one script
    can_pass = ctx["garbled_replacements"] > 0 and ctx["garbled_controls"] > 0 and ctx["garbled_scripts"] > 1
    plain = ctx.decoder.printable_ascii(ids, skip_special_tokens=True) if can_pass else [False] * len(ids)
    todo = [i for i, sure in enumerate(plain) if not sure]
    texts = ctx.decoder.decode_many(
        [ids[i] if isinstance(ids[i], list) else ids[i].tolist() for i in todo], skip_special_tokens=True
    )
    for turn, text in zip(todo, texts):
        reasons = garbled_reasons(text, ctx)
        if reasons:
            yield _finding(
                "garbled",
                traj,
                ERROR,
                f"model call {turn}: {'; '.join(reasons)}",
                turn=turn,
                score=len(reasons),
            )


def length_stop(adapter: Any, span: Any) -> str | None:
    """How a model call stopped on its length limit, as its adapter reads the call (the ``truncated``
    check's one rule, which ``show`` and the UI's chat mark too): ``stopped on its length limit (stop
    reason 'length', 8 tokens)``, or ``generated 8 tokens, its max_tokens 8``; None when it did not."""
    stops = getattr(adapter.fields, "length_stops", ("length",))
    reason = adapter.stop_reason(span)
    _, response = adapter.call_ids(span)
    if reason in stops:
        tokens = f", {len(response)} tokens" if response is not None else ""
        return f"stopped on its length limit (stop reason {reason!r}{tokens})"
    limit = adapter.max_tokens(span)
    if limit is not None and response is not None and len(response) >= limit:
        return f"generated {len(response)} tokens, its max_tokens {limit}"
    return None


def length_stops(traj: Any, adapter: Any) -> dict[str, str]:
    """The trajectory's model calls that stopped on their length limit: span id -> :func:`length_stop`."""
    found = ((s.span_id, length_stop(adapter, s)) for s in _calls(traj, KIND_LLM))
    return {span_id: how for span_id, how in found if how is not None}


def truncated(traj: Any, ctx: Context) -> Iterator[Finding]:
    for turn, span in enumerate(_calls(traj, KIND_LLM)):
        how = length_stop(ctx.adapter, span)
        if how is None:
            continue
        _, response = ctx.adapter.call_ids(span)
        yield _finding(
            "truncated",
            traj,
            WARNING,
            f"model call {turn} {how}",
            turn=turn,
            score=len(response) if response is not None else 0,
        )


def empty_response(traj: Any, ctx: Context) -> Iterator[Finding]:
    for turn, span in enumerate(_calls(traj, KIND_LLM)):
        _, response = ctx.adapter.call_ids(span)
        if span.status == "ok" and response is not None and len(response) == 0:
            reason = ctx.adapter.stop_reason(span)
            yield _finding(
                "empty_response",
                traj,
                ERROR,
                f"model call {turn} returned no tokens" + (f" (stop reason {reason!r})" if reason else ""),
                turn=turn,
                score=1,
            )


def _span_errors(traj: Any, kind: str, check: str, what: Any) -> Iterator[Finding]:
    for turn, span in enumerate(_calls(traj, kind)):
        why = what(span)
        if why:
            text = " ".join(str(why).split())
            yield _finding(check, traj, WARNING, f"{span.name} call {turn}: {text[:160]}", turn=turn, score=1)


def tool_error(traj: Any, ctx: Context) -> Iterator[Finding]:
    return _span_errors(traj, KIND_TOOL, "tool_error", ctx.adapter.tool_error)


def parse_error(traj: Any, ctx: Context) -> Iterator[Finding]:
    return _span_errors(traj, KIND_PARSER, "parse_error", ctx.adapter.parse_error)


RETOKENIZATION = Check(
    "retokenization",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "model call k+1's prompt ids do not begin with call k's prompt + response ids (the agent loop "
    "re-tokenized text: the trainer sees tokens the model never sampled); reports the turn and the "
    "first differing position",
    retokenization,
    span_kinds=(KIND_LLM,),
)
REPETITION = Check(
    "repetition",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "a response that degenerates into one n-gram (up to repetition_max_ngram tokens) repeated at least "
    "repetition_min_repeats times over at least repetition_min_tokens tokens",
    repetition,
    {"repetition_max_ngram": 32, "repetition_min_repeats": 4, "repetition_min_tokens": 32},
    span_kinds=(KIND_LLM,),
)
GARBLED = Check(
    "garbled",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "decoded response text with garbled_replacements replacement characters, garbled_controls control "
    "characters, or garbled_scripts scripts of garbled_script_letters letters each (needs the tokenizer; "
    "skipped with a note without one)",
    garbled,
    {"garbled_replacements": 2, "garbled_controls": 1, "garbled_scripts": 3, "garbled_script_letters": 3},
    needs_tokenizer=True,
    span_kinds=(KIND_LLM,),
)
TRUNCATED = Check(
    "truncated",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    'a model call that stopped on its length limit (stop reason "length", or as many tokens as the '
    "request's max_tokens)",
    truncated,
    span_kinds=(KIND_LLM,),
)
EMPTY_RESPONSE = Check(
    "empty_response",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "a model call that returned no token ids",
    empty_response,
    span_kinds=(KIND_LLM,),
)
TOOL_ERROR = Check(
    "tool_error",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "a tool call that raised, or whose result says it failed (an error, ok or success false, or a "
    "response text beginning with error/exception/traceback): the listing's tool_errors, counted alike",
    tool_error,
    span_kinds=(KIND_TOOL,),
)
PARSE_ERROR = Check(
    "parse_error",
    OVER_TRAJECTORIES,
    LEVEL_TRAJECTORY,
    "a parser call that raised, or returned a tool call without a name or with arguments that are not "
    "a JSON object",
    parse_error,
    span_kinds=(KIND_PARSER,),
)
