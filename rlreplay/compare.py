"""Comparing two runs trajectory by trajectory: pairs by keys, same or not, and where they first differ.

Trajectories of the two runs are paired by (step, sample_index, rollout_n, validate); when several
share keys, the k-th of A goes with the k-th of B in listing order. A pair is *same* when its spans
agree in order (depth first, children by start time), name, kind, inputs, output and error. Times,
span and trajectory ids, worker names, per-call ids (``request_id``, ``instance_id``, fresh on
every run) and what a framework adapter names in ``volatile_keys`` (verl: the agent loop's timing
``metrics``, rlreplay's own trajectory key) are ignored, and so are ``signals`` rows (the
trainer's, written by another process).
A changed pair names its first difference in call order (a span's inputs when it opens, its output
when it closes, after its children's): the span (its index in depth-first order and its name), the
field, the path inside it, both values there as short JSON texts (``a`` and ``b``: :func:`excerpts`),
and the conversation turn where the token ids first part (``diff``'s alignment).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from rlreplay.adapters.registry import adapter_for_run, get_adapter
from rlreplay.diff.align import first_divergence
from rlreplay.format.keys import FIELDS, KEY_STR
from rlreplay.format.payload import first_type_difference, pointer_keys, same
from rlreplay.format.schema import KIND_SIGNALS
from rlreplay.model import Span, Trajectory, listing_rows
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.recorder.matchers import ABSENT, comparable, first_values
from rlreplay.text.conversation import turns

Keys = tuple[Any, Any, Any, Any]


@dataclass
class Pair:
    step: Any
    sample_index: Any
    rollout_n: Any
    validate: bool | None
    a: str | None
    b: str | None
    same: bool
    first_difference: dict[str, Any] | None
    reward_a: float | None = None
    reward_b: float | None = None

    @property
    def status(self) -> str:
        if self.a is None:
            return "only_b"
        if self.b is None:
            return "only_a"
        return "same" if self.same else "changed"

    @property
    def reward_delta(self) -> float | None:
        if self.reward_a is None or self.reward_b is None:
            return None
        return self.reward_b - self.reward_a

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: What pairs two trajectories: their keys but the experiment (a replay may run under another name).
PAIR_KEYS = tuple(f for f in FIELDS if f != "experiment")


def _rows(table: Any) -> list[dict[str, Any]]:
    return listing_rows(table.select(["id", *PAIR_KEYS, *KEY_STR.values(), "reward"]))


def _keys(row: dict[str, Any]) -> Keys:
    return tuple(row[k] for k in PAIR_KEYS)  # type: ignore[return-value]


def pairs(table_a: Any, table_b: Any) -> list[tuple[Keys, dict[str, Any] | None, dict[str, Any] | None]]:
    """Rows of two listings paired by keys (k-th with k-th among equal keys), in A's order then B's."""
    by_b: dict[Keys, list[dict[str, Any]]] = {}
    for row in _rows(table_b):
        by_b.setdefault(_keys(row), []).append(row)
    out: list[tuple[Keys, dict[str, Any] | None, dict[str, Any] | None]] = []
    for row in _rows(table_a):
        keys = _keys(row)
        waiting = by_b.get(keys)
        out.append((keys, row, waiting.pop(0) if waiting else None))
    for keys, rest in by_b.items():
        out.extend((keys, None, row) for row in rest)
    return out


def ordered_spans(traj: Trajectory) -> list[Span]:
    """The trajectory's spans depth first, children by start time; no ``signals`` rows."""
    return [span for span, opening in _events(traj) if opening]


def _events(traj: Trajectory) -> list[tuple[Span, bool]]:
    """Each span's opening (its inputs are known) and closing (its output), in call order."""
    out: list[tuple[Span, bool]] = []

    def visit(span: Span) -> None:
        if span.kind == KIND_SIGNALS:
            return
        out.append((span, True))
        for child in sorted(span.children, key=lambda s: (s.start_ns, s.name)):
            visit(child)
        out.append((span, False))

    for root in sorted(traj.roots, key=lambda s: (s.start_ns, s.name)):
        visit(root)
    return out


def volatile_keys(*adapters: Any) -> frozenset[str]:
    """The keys any of ``adapters`` names volatile (None: the generic adapter): never compared."""
    return frozenset().union(*((a or get_adapter()).volatile_keys() for a in adapters))


#: Characters of each value a first difference shows (around where the two first differ).
SHOWN_CHARS = 80


def _json_text(value: Any) -> str | None:
    if value is ABSENT:
        return None
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # an int beyond 64 bits, or not a JSON value (shown as Python shows it)
        return json.dumps(value, ensure_ascii=False, default=repr)


def excerpts(a: Any, b: Any, limit: int = SHOWN_CHARS) -> tuple[str | None, str | None]:
    """Two differing values as short texts that show how they differ: each one's JSON, both cut to
    the same window of ``limit`` characters around the first character where they part (``…`` where
    cut); None for a side that has no value (:data:`rlreplay.recorder.matchers.ABSENT`)."""
    text_a, text_b = _json_text(a), _json_text(b)
    if text_a is None or text_b is None:
        return tuple(t if t is None or len(t) <= limit else t[: limit - 1] + "…" for t in (text_a, text_b))
    same = next((i for i, (x, y) in enumerate(zip(text_a, text_b)) if x != y), min(len(text_a), len(text_b)))
    start = max(0, min(same - limit // 4, max(len(text_a), len(text_b)) - limit))
    out = []
    for text in (text_a, text_b):
        piece = text[start : start + limit]
        out.append(("…" if start else "") + piece + ("…" if start + limit < len(text) else ""))
    return out[0], out[1]


def first_difference(
    a: Trajectory, b: Trajectory, adapter_a: Any = None, adapter_b: Any = None
) -> dict[str, Any] | None:
    """The first span and field where two trajectories differ, or None when they are the same."""
    ignored = volatile_keys(adapter_a, adapter_b)
    events_a, events_b = _events(a), _events(b)
    index_a = {id(span): i for i, span in enumerate(s for s, opening in events_a if opening)}
    index_b = {id(span): i for i, span in enumerate(s for s, opening in events_b if opening)}
    found: dict[str, Any] | None = None
    for i in range(max(len(events_a), len(events_b))):
        ea = events_a[i] if i < len(events_a) else None
        eb = events_b[i] if i < len(events_b) else None
        if ea is None or eb is None or ea[1] != eb[1]:  # one run has a span here that the other lacks
            extra_in_a = eb is None or (ea is not None and ea[1])
            span = ea[0] if extra_in_a else eb[0]  # type: ignore[index]
            at = index_a[id(span)] if extra_in_a else index_b[id(span)]
            found = {"span": at, "name": span.name, "field": "span", "path": None}
            found["a"], found["b"] = (span.name, None) if extra_in_a else (None, span.name)
            found["ended"] = "b" if extra_in_a else "a"
            break
        (sa, opening), (sb, _) = ea, eb
        for name in ("name", "kind", "inputs") if opening else ("output", "error"):
            va, vb = getattr(sa, name), getattr(sb, name)
            if name in ("inputs", "output"):
                va, vb = comparable(va, ignored), comparable(vb, ignored)
            if not same(va, vb):
                path = None
                if name in ("inputs", "output"):
                    path, va, vb = first_values(va, vb)
                found = {"span": index_a[id(sa)], "name": sa.name, "field": name, "path": path or None}
                found["a"], found["b"] = excerpts(va, vb)
                found["ended"] = None
                break
            if name == "output":
                found = _type_difference(index_a[id(sa)], sa, sb, va, ignored)
                if found is not None:
                    break
        if found:
            break
    if found is None:
        return None
    divergence = first_divergence(turns(a, None, adapter_a), turns(b, None, adapter_b))
    found["turn"] = divergence.turn if divergence is not None else None
    return found


def _type_difference(
    at: int, sa: Span, sb: Span, output: Any, ignored: frozenset[str]
) -> dict[str, Any] | None:
    """Outputs of the same JSON form that were of other types (a tuple and a list): the first
    place where their type records differ, with the types there (``output_type``)."""
    pointer = first_type_difference(sa.output_type, sb.output_type, ignored)
    if pointer is None:
        return None
    path, node = "", output
    for key in pointer_keys(pointer):
        if type(node) is list and key.isdigit() and int(key) < len(node):
            path, node = f"{path}[{key}]", node[int(key)]
        else:
            path, node = (f"{path}.{key}" if path else key), node.get(key) if type(node) is dict else None
    natural = f"builtins.{type(node).__name__}"  # a record names only what JSON does not say
    types = [record.get(pointer, natural) for record in (sa.output_type or {}, sb.output_type or {})]
    a, b = excerpts(*types)
    return {
        "span": at,
        "name": sa.name,
        "field": "output_type",
        "path": path or None,
        "a": a,
        "b": b,
        "ended": None,
    }


def where(diff: dict[str, Any] | None) -> str:
    """A first difference in words: ``span 2 parse: output at [0]; tokens first differ in turn 1``."""
    if diff is None:
        return ""
    at = f"span {diff['span']} {diff['name']}: {diff['field']}"
    if diff.get("path"):
        at += f" at {diff['path']}"
    if diff.get("ended"):
        at += f" (run {diff['ended'].upper()} has no span there)"
    if diff.get("turn") is not None:
        at += f"; tokens first differ in turn {diff['turn']}"
    return at


def _by_step(items: list[tuple[Keys, Any, Any]]) -> dict[Any, list[tuple[Keys, Any, Any]]]:
    out: dict[Any, list[tuple[Keys, Any, Any]]] = {}
    for item in items:
        out.setdefault(item[0][0], []).append(item)
    return out


def _load(run: Run, ids: list[str], step: Any) -> dict[str, Trajectory]:
    filters = Filters(step=step) if isinstance(step, int) else None
    return {t.id: t for t in run.load(ids, filters)}


def compare_runs(run_a: Run, run_b: Run, selection: Any = None, fast: bool = True) -> Iterator[Pair]:
    """Every pair of the two runs (``selection``: a ``rlreplay.read.selection.Selection`` applied to
    both), one step at a time, in A's listing order then B's trajectories of its own.

    ``fast``: each step's spans are read once per run and the pairs compared column by column as
    stored (``rlreplay.read.samestep``); only pairs not found equal that way are built as
    trajectories and compared span by span. The result is the same either way.
    """
    if selection is not None:
        table_a, table_b = selection.trajectories(run_a), selection.trajectories(run_b)
    else:
        table_a, table_b = run_a.trajectories(), run_b.trajectories()
    adapter_a, adapter_b = adapter_for_run(run_a), adapter_for_run(run_b)
    ignored = volatile_keys(adapter_a, adapter_b)
    for step, items in _by_step(pairs(table_a, table_b)).items():
        both = [(ra, rb) for _, ra, rb in items if ra is not None and rb is not None]
        ids_a, ids_b = [ra["id"] for ra, _ in both], [rb["id"] for _, rb in both]
        if fast and type(step) is int and both:
            found = _step_pairs(run_a, run_b, step, ids_a, ids_b, ignored, adapter_a, adapter_b)
        else:
            loaded_a, loaded_b = _load(run_a, ids_a, step), _load(run_b, ids_b, step)
            found = {}
            for ia, ib in zip(ids_a, ids_b):
                ta, tb = loaded_a.get(ia), loaded_b.get(ib)
                if ta is not None and tb is not None:
                    difference = first_difference(ta, tb, adapter_a, adapter_b)
                    found[ia, ib] = (difference is None, difference)
        for keys, ra, rb in items:
            same, difference = False, None
            if ra is not None and rb is not None:
                same, difference = found.get((ra["id"], rb["id"]), (False, None))
            yield Pair(
                *keys,
                a=ra["id"] if ra else None,
                b=rb["id"] if rb else None,
                same=same,
                first_difference=difference,
                reward_a=ra["reward"] if ra else None,
                reward_b=rb["reward"] if rb else None,
            )


def _step_pairs(
    run_a: Run,
    run_b: Run,
    step: int,
    ids_a: list[str],
    ids_b: list[str],
    ignored: frozenset[str],
    adapter_a: Any,
    adapter_b: Any,
) -> dict[tuple[str, str], tuple[bool, dict[str, Any] | None]]:
    """(same, first difference) of the pairs ``zip(ids_a, ids_b)`` of one step: equal as stored
    (``samestep.equal_as_stored``), else built and compared span by span."""
    from rlreplay.read.samestep import equal_as_stored
    from rlreplay.read.scan import step_spans

    spans_a, spans_b = step_spans(run_a, step, ids_a), step_spans(run_b, step, ids_b)
    equal = equal_as_stored(spans_a, spans_b, ignored)
    out: dict[tuple[str, str], tuple[bool, dict[str, Any] | None]] = {}
    for i, (ia, ib) in enumerate(zip(ids_a, ids_b)):
        if equal[i]:
            out[ia, ib] = (True, None)
            continue
        ta = spans_a.trajectory(i, lambda m: run_a.warn(f"step {step}: {m}"))
        tb = spans_b.trajectory(i, lambda m: run_b.warn(f"step {step}: {m}"))
        if ta is not None and tb is not None:
            difference = first_difference(ta, tb, adapter_a, adapter_b)
            out[ia, ib] = (difference is None, difference)
    return out


def summary(result: list[Pair]) -> dict[str, Any]:
    """Counts of same / changed / only_a / only_b pairs, and the reward deltas of paired ones."""
    counts = dict.fromkeys(("same", "changed", "only_a", "only_b"), 0)
    deltas = []
    for pair in result:
        counts[pair.status] += 1
        if pair.reward_delta is not None:
            deltas.append(pair.reward_delta)
    changed = [d for d in deltas if d != 0]
    return {
        **counts,
        "reward_changed": len(changed),
        "reward_delta_sum": sum(deltas) if deltas else 0.0,
        "reward_delta_mean": sum(deltas) / len(deltas) if deltas else None,
    }
