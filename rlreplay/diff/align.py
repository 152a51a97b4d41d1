"""Comparing two trajectories: where their conversations part ways, turn by turn.

Token ids are the ground truth. The two conversations (``rlreplay.text.conversation.turns``) are
aligned turn by turn; each aligned pair is ``equal``, ``changed``, ``only_a`` or ``only_b``.
Changed turns get a word-level diff of their text when a decoder is given, else a token-level
diff of their ids. The *first divergence* is the first token where the prompt or the response
ids differ: the turn that holds it (turn 0 is the prompt), the offset within that turn, and
the offset within the response (``None`` when the prompts differ).

Trajectories are picked by id (or unique prefix) or by a *selector* such as
``step=5,sample_index=12,rollout_n=0``; the second one may give only the keys that change.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlreplay.adapters.registry import adapter_for_run, get_adapter
from rlreplay.errors import SelectorError
from rlreplay.format.keys import key_order
from rlreplay.format.schema import KIND_LLM, KIND_TOOL
from rlreplay.model import Trajectory
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run
from rlreplay.text.conversation import ROLE_ASSISTANT, ROLE_PROMPT, ROLE_TOOL, BatchDecoder, Turn, turns

EQUAL = "equal"
CHANGED = "changed"
ONLY_A = "only_a"
ONLY_B = "only_b"

#: Use rapidfuzz (when installed) for edit scripts; difflib otherwise.
USE_RAPIDFUZZ = True
#: Without rapidfuzz: above this many element pairs, difflib's popularity heuristic (autojunk) is on.
EXACT_DIFF_LIMIT = 4_000_000


# ---- the diff model ----------------------------------------------------------------------------


@dataclass
class Segment:
    """A piece of a diff: ``equal`` (a == b) or ``change`` (a replaced by b; either may be empty)."""

    op: str
    a: Any  # str (words) or list[int] (tokens)
    b: Any

    def to_dict(self) -> dict[str, Any]:
        if self.op == EQUAL:
            return {"op": EQUAL, "value": self.a}
        return {"op": "change", "a": self.a, "b": self.b}


@dataclass
class TurnDiff:
    status: str  # equal | changed | only_a | only_b
    role: str
    index_a: int | None
    index_b: int | None
    turn_a: Turn | None
    turn_b: Turn | None
    first_diff: int | None = None  # token offset within the turn where the ids first differ
    unit: str = "tokens"  # of the segments: "words" (text) or "tokens" (ids)
    segments: list[Segment] = field(default_factory=list)
    duration_a_s: float | None = None
    duration_b_s: float | None = None

    @property
    def tool_calls_changed(self) -> bool:
        a = self.turn_a.tool_calls if self.turn_a else []
        b = self.turn_b.tool_calls if self.turn_b else []
        return a != b

    @property
    def same_text(self) -> bool:
        """Different token ids that decode to the same text."""
        return (
            self.status == CHANGED
            and self.turn_a is not None
            and self.turn_b is not None
            and self.turn_a.text is not None
            and self.turn_a.text == self.turn_b.text
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status,
            "role": self.role,
            "index_a": self.index_a,
            "index_b": self.index_b,
            "tokens_a": len(self.turn_a.token_ids) if self.turn_a else None,
            "tokens_b": len(self.turn_b.token_ids) if self.turn_b else None,
            "start_a": self.turn_a.start if self.turn_a else None,
            "start_b": self.turn_b.start if self.turn_b else None,
        }
        if self.status != EQUAL:
            out["first_diff"] = self.first_diff
            out["unit"] = self.unit
            out["diff"] = [s.to_dict() for s in self.segments]
            if self.same_text:
                out["same_text"] = True
        if self.role == ROLE_ASSISTANT:
            out["tool_calls_a"] = self.turn_a.tool_calls if self.turn_a else None
            out["tool_calls_b"] = self.turn_b.tool_calls if self.turn_b else None
            out["tool_calls_changed"] = self.tool_calls_changed
            out["duration_a_s"] = self.duration_a_s
            out["duration_b_s"] = self.duration_b_s
        return out


@dataclass
class Divergence:
    """The first token where the two conversations differ."""

    turn: int  # index in A's turns (B's when A has ended there); 0 = the prompt
    token_offset: int  # within that turn
    response_offset: int | None  # within the response; None when the prompts differ
    turn_b: int | None = None
    token_offset_b: int | None = None
    ended: str | None = None  # "a" or "b" when one side simply stops there

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "token_offset": self.token_offset,
            "response_offset": self.response_offset,
            "turn_b": self.turn_b,
            "token_offset_b": self.token_offset_b,
            "ended": self.ended,
        }


def format_tool_calls(calls: list[dict[str, Any]] | None) -> str:
    """``name({"arg": ...}), ...`` for a turn's parsed tool calls, or ``none``."""
    if not calls:
        return "none"
    import orjson

    return ", ".join(
        f"{c.get('name')}({orjson.dumps(c.get('arguments'), option=orjson.OPT_NON_STR_KEYS).decode()})"
        for c in calls
    )


@dataclass
class Side:
    """What one trajectory of the pair looks like, in numbers."""

    id: str
    run: str | None
    step: int | None
    sample_index: int | None
    rollout_n: int | None
    validate: bool | None
    experiment: str | None
    worker: str
    reward: float | None
    advantage: float | None
    logprob_diff_max: float | None
    importance_ratio: float | None
    status: str
    model_calls: int  # counted as the listing counts them (``Trajectory.model_calls``)
    tool_calls: int
    tool_errors: int
    prompt_tokens: int
    response_tokens: int
    model_tokens: int
    duration_s: float
    llm_s: float
    tool_s: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: Fields of ``Side`` whose B − A difference is reported.
DELTA_FIELDS = (
    "reward",
    "model_calls",
    "tool_calls",
    "tool_errors",
    "prompt_tokens",
    "response_tokens",
    "model_tokens",
    "duration_s",
    "llm_s",
    "tool_s",
)


@dataclass
class ToolDiff:
    status: str  # equal | changed | only_a | only_b (durations do not count)
    index: int
    a: dict[str, Any] | None
    b: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "index": self.index, "a": self.a, "b": self.b}


@dataclass
class TrajectoryDiff:
    a: Side
    b: Side
    turns: list[TurnDiff]
    tools: list[ToolDiff]
    first_divergence: Divergence | None
    text: bool  # whether turns were decoded to text

    @property
    def identical(self) -> bool:
        return (
            self.first_divergence is None
            and all(t.status == EQUAL and not t.tool_calls_changed for t in self.turns)
            and all(t.status == EQUAL for t in self.tools)
            and self.a.reward == self.b.reward
            and self.a.status == self.b.status
        )

    @property
    def deltas(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        for name in DELTA_FIELDS:
            va, vb = getattr(self.a, name), getattr(self.b, name)
            out[name] = None if va is None or vb is None else vb - va
        return out

    def counts(self) -> dict[str, int]:
        out = {EQUAL: 0, CHANGED: 0, ONLY_A: 0, ONLY_B: 0}
        for t in self.turns:
            out[t.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "deltas": self.deltas,
            "turn_counts": self.counts(),
            "text": self.text,
            "turns": [t.to_dict() for t in self.turns],
            "tools": [t.to_dict() for t in self.tools],
        }


# ---- token sequences ---------------------------------------------------------------------------


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix (slice comparisons run at C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix_len(a: Sequence[Any], b: Sequence[Any], limit: int) -> int:
    """Length of the longest common suffix, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n == 0 or a[len(a) - n :] == b[len(b) - n :]:
        return n
    lo, hi = 0, n  # the last lo items agree; the last hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[len(a) - mid : len(a) - lo] == b[len(b) - mid : len(b) - lo]:
            lo = mid
        else:
            hi = mid
    return lo


def _response(conv: list[Turn]) -> list[int]:
    out: list[int] = []
    for t in conv:
        if t.role != ROLE_PROMPT:
            out.extend(t.token_ids)
    return out


def _prompt(conv: list[Turn]) -> list[int]:
    return conv[0].token_ids if conv and conv[0].role == ROLE_PROMPT else []


def _turn_at(conv: list[Turn], offset: int) -> tuple[int, int] | None:
    """(turn index, offset within it) of response offset ``offset``; None past the end."""
    idx = [i for i, t in enumerate(conv) if t.role != ROLE_PROMPT and t.token_ids]
    starts = [conv[i].start for i in idx]
    k = bisect.bisect_right(starts, offset) - 1
    if k < 0:
        return None
    turn = conv[idx[k]]
    if offset >= turn.end:
        return None
    return idx[k], offset - turn.start


def first_divergence(conv_a: list[Turn], conv_b: list[Turn]) -> Divergence | None:
    """The first token where the two conversations' ids differ, or None when they are identical."""
    pa, pb = _prompt(conv_a), _prompt(conv_b)
    k = common_prefix_len(pa, pb)
    if k < len(pa) or k < len(pb):
        ended = "a" if k == len(pa) else "b" if k == len(pb) else None
        return Divergence(
            turn=0, token_offset=k, response_offset=None, turn_b=0, token_offset_b=k, ended=ended
        )
    ra, rb = _response(conv_a), _response(conv_b)
    k = common_prefix_len(ra, rb)
    if k == len(ra) and k == len(rb):
        return None
    at_a, at_b = _turn_at(conv_a, k), _turn_at(conv_b, k)
    if at_a is not None:
        turn, offset = at_a
    else:  # A ended: the divergence is B's next token
        assert at_b is not None
        turn, offset = at_b
    ended = "a" if at_a is None else "b" if at_b is None else None
    return Divergence(
        turn=turn,
        token_offset=offset,
        response_offset=k,
        turn_b=at_b[0] if at_b else None,
        token_offset_b=at_b[1] if at_b else None,
        ended=ended,
    )


# ---- alignment ---------------------------------------------------------------------------------


def align_turns(conv_a: list[Turn], conv_b: list[Turn]) -> list[tuple[int | None, int | None]]:
    """Pairs of turn indices: identical turns matched as in a line diff, the rest paired by role."""
    keys_a = [(t.role, tuple(t.token_ids)) for t in conv_a]
    keys_b = [(t.role, tuple(t.token_ids)) for t in conv_b]
    pairs: list[tuple[int | None, int | None]] = []
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(i1, i2), range(j1, j2)))
            continue
        roles_a = [conv_a[i].role for i in range(i1, i2)]
        roles_b = [conv_b[j].role for j in range(j1, j2)]
        sub = difflib.SequenceMatcher(None, roles_a, roles_b, autojunk=False)
        for stag, s1, s2, t1, t2 in sub.get_opcodes():
            if stag == "equal":
                pairs.extend(zip(range(i1 + s1, i1 + s2), range(j1 + t1, j1 + t2)))
            else:
                pairs.extend((i, None) for i in range(i1 + s1, i1 + s2))
                pairs.extend((None, j) for j in range(j1 + t1, j1 + t2))
    return pairs


_WORD = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)


def split_words(text: str) -> list[str]:
    """Words, runs of whitespace and single punctuation marks; joining them gives ``text`` back."""
    return _WORD.findall(text)


def diff_sequences(a: Sequence[Any], b: Sequence[Any], words: bool = False) -> list[Segment]:
    """Segments turning ``a`` into ``b``: common prefix and suffix first, difflib on the middle.

    Short equal runs caught between two changes are folded into them (as diff-match-patch's
    semantic cleanup does), so that a shared space or ``the`` does not chop a rewrite apart.
    """
    pre = common_prefix_len(a, b)
    suf = common_suffix_len(a, b, min(len(a), len(b)) - pre)
    mid_a, mid_b = a[pre : len(a) - suf], b[pre : len(b) - suf]
    raw: list[list[Any]] = []
    if pre:
        raw.append([EQUAL, list(a[:pre]), list(b[:pre])])
    if mid_a or mid_b:
        for tag, i1, i2, j1, j2 in _opcodes(mid_a, mid_b):
            op = EQUAL if tag == "equal" else "change"
            if raw and raw[-1][0] == op == "change":
                raw[-1][1].extend(mid_a[i1:i2])
                raw[-1][2].extend(mid_b[j1:j2])
            else:
                raw.append([op, list(mid_a[i1:i2]), list(mid_b[j1:j2])])
    if suf:
        raw.append([EQUAL, list(a[len(a) - suf :]), list(b[len(b) - suf :])])
    merged = _fold_short_equalities(raw, words)
    join = "".join if words else list
    return [Segment(op, join(sa), join(sb)) for op, sa, sb in merged]


def _opcodes(a: Sequence[Any], b: Sequence[Any]) -> list[tuple[str, int, int, int, int]]:
    """An edit script from ``a`` to ``b``: rapidfuzz's LCS (C++, bit-parallel) if installed, else difflib."""
    if USE_RAPIDFUZZ:
        try:
            from rapidfuzz.distance import Indel
        except ImportError:
            pass
        else:
            return [
                (op.tag, op.src_start, op.src_end, op.dest_start, op.dest_end) for op in Indel.opcodes(a, b)
            ]
    autojunk = len(a) * len(b) > EXACT_DIFF_LIMIT
    return difflib.SequenceMatcher(None, a, b, autojunk=autojunk).get_opcodes()


def _size(items: list[Any], words: bool) -> int:
    return sum(map(len, items)) if words else len(items)


def _fold_short_equalities(raw: list[list[Any]], words: bool) -> list[list[Any]]:
    # each entry: [op, a items, b items, size of a, size of b] (sizes kept, not recounted)
    sized = [[op, a, b, _size(a, words), _size(b, words)] for op, a, b in raw]
    out: list[list[Any]] = []
    for i, seg in enumerate(sized):
        if seg[0] == EQUAL and out and out[-1][0] == "change" and i + 1 < len(sized):
            before, after = out[-1], sized[i + 1]
            if (
                after[0] == "change"
                and seg[3] <= max(before[3], before[4])
                and seg[3] <= max(after[3], after[4])
            ):
                _absorb(before, seg)
                continue
        if seg[0] == "change" and out and out[-1][0] == "change":
            _absorb(out[-1], seg)
            continue
        out.append([seg[0], list(seg[1]), list(seg[2]), seg[3], seg[4]])
    return [seg[:3] for seg in out]


def _absorb(into: list[Any], seg: list[Any]) -> None:
    into[1].extend(seg[1])
    into[2].extend(seg[2])
    into[3] += seg[3]
    into[4] += seg[4]


def _turn_segments(ta: Turn | None, tb: Turn | None, use_text: bool) -> list[Segment]:
    if use_text:
        text_a = (ta.text or "") if ta else ""
        text_b = (tb.text or "") if tb else ""
        return diff_sequences(split_words(text_a), split_words(text_b), words=True)
    return diff_sequences(ta.token_ids if ta else [], tb.token_ids if tb else [])


# ---- trajectories ------------------------------------------------------------------------------


def _side(traj: Trajectory, conv: list[Turn], run: Run | None) -> Side:
    llm = traj.by_kind(KIND_LLM)
    tools = traj.by_kind(KIND_TOOL)
    model = [t for t in conv if t.role == ROLE_ASSISTANT]
    tool_turns = [t for t in conv if t.role == ROLE_TOOL]
    return Side(
        id=traj.id,
        run=str(run.path) if run is not None else None,
        **asdict(traj.key),
        worker=traj.worker,
        reward=traj.reward,
        advantage=traj.row.get("advantage"),
        logprob_diff_max=traj.row.get("logprob_diff_max"),
        importance_ratio=traj.row.get("importance_ratio"),
        status=traj.status,
        model_calls=traj.model_calls,
        tool_calls=traj.tool_calls,
        tool_errors=traj.tool_errors,
        prompt_tokens=len(_prompt(conv)),
        response_tokens=sum(len(t.token_ids) for t in model) + sum(len(t.token_ids) for t in tool_turns),
        model_tokens=sum(len(t.token_ids) for t in model),
        duration_s=(traj.end_ns - traj.start_ns) / 1e9 if traj.spans else 0.0,
        llm_s=sum(s.duration_s for s in llm),
        tool_s=sum(s.duration_s for s in tools),
    )


def _tool_info(span: Any) -> dict[str, Any]:
    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    return {
        "name": span.name,
        "parameters": inputs.get("parameters"),
        "status": span.status,
        "error": span.error,
        "duration_s": span.duration_s,
    }


def _same_tool(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("name", "parameters", "status", "error"))


def diff_tools(a: Trajectory, b: Trajectory) -> list[ToolDiff]:
    """Tool calls of the two trajectories side by side, in call order."""
    ta = [_tool_info(s) for s in sorted(a.by_kind(KIND_TOOL), key=lambda s: s.start_ns)]
    tb = [_tool_info(s) for s in sorted(b.by_kind(KIND_TOOL), key=lambda s: s.start_ns)]
    out = []
    for i in range(max(len(ta), len(tb))):
        ia = ta[i] if i < len(ta) else None
        ib = tb[i] if i < len(tb) else None
        if ia is None:
            status = ONLY_B
        elif ib is None:
            status = ONLY_A
        else:
            status = EQUAL if _same_tool(ia, ib) else CHANGED
        out.append(ToolDiff(status, i, ia, ib))
    return out


def diff_conversations(conv_a: list[Turn], conv_b: list[Turn]) -> tuple[list[TurnDiff], Divergence | None]:
    """Aligned turn pairs with their diffs, and the first divergence."""
    use_text = all(t.text is not None for t in conv_a) and all(t.text is not None for t in conv_b)
    use_text = use_text and bool(conv_a or conv_b)
    unit = "words" if use_text else "tokens"
    result: list[TurnDiff] = []
    for ia, ib in align_turns(conv_a, conv_b):
        ta = conv_a[ia] if ia is not None else None
        tb = conv_b[ib] if ib is not None else None
        role = (ta or tb).role  # type: ignore[union-attr]
        if ta is not None and tb is not None:
            same = ta.token_ids == tb.token_ids
            status = EQUAL if same else CHANGED
        else:
            status = ONLY_A if tb is None else ONLY_B
        item = TurnDiff(status, role, ia, ib, ta, tb, unit=unit)
        if status != EQUAL:
            item.first_diff = common_prefix_len(ta.token_ids if ta else [], tb.token_ids if tb else [])
            item.segments = _turn_segments(ta, tb, use_text)
        result.append(item)
    return result, first_divergence(conv_a, conv_b)


def _durations(traj: Trajectory) -> dict[str, float]:
    return {s.span_id: s.duration_s for s in traj.by_kind(KIND_LLM)}


def _adapter(run: Run | None) -> Any:
    return adapter_for_run(run) if run is not None else get_adapter()


def diff_trajectories(
    a: Trajectory,
    b: Trajectory,
    decoder: BatchDecoder | None = None,
    run_a: Run | None = None,
    run_b: Run | None = None,
) -> TrajectoryDiff:
    """Compare two trajectories; with ``decoder``, changed turns get a word-level text diff."""
    conv_a = turns(a, decoder, _adapter(run_a))
    conv_b = turns(b, decoder, _adapter(run_b or run_a))
    # span ids are unique per run, not across runs: look durations up per side
    pairs, divergence = diff_conversations(conv_a, conv_b)
    dur_a, dur_b = _durations(a), _durations(b)
    for p in pairs:
        if p.turn_a is not None and p.turn_a.span_id:
            p.duration_a_s = dur_a.get(p.turn_a.span_id)
        if p.turn_b is not None and p.turn_b.span_id:
            p.duration_b_s = dur_b.get(p.turn_b.span_id)
    return TrajectoryDiff(
        a=_side(a, conv_a, run_a),
        b=_side(b, conv_b, run_b),
        turns=pairs,
        tools=diff_tools(a, b),
        first_divergence=divergence,
        text=decoder is not None and bool(pairs) and pairs[0].unit == "words",
    )


# ---- a whole group -----------------------------------------------------------------------------


@dataclass
class GroupMember:
    side: Side
    first_divergence: Divergence | None
    best: bool
    preview_best: Any = None  # what the best rollout says from the divergence on (text or ids)
    preview: Any = None  # what this rollout says there

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.side.to_dict(),
            "best": self.best,
            "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
            "preview_best": self.preview_best,
            "preview": self.preview,
        }


@dataclass
class GroupDiff:
    step: int | None
    sample_index: int | None
    validate: bool | None
    best_id: str
    members: list[GroupMember]
    loaded: dict[str, Trajectory] = field(default_factory=dict, repr=False)  # the rollouts read, by id

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sample_index": self.sample_index,
            "validate": self.validate,
            "best": self.best_id,
            "rollouts": [m.to_dict() for m in self.members],
        }


PREVIEW_TOKENS = 16


def _reward_rank(side: Side) -> tuple[float, Any]:
    reward = side.reward if side.reward is not None else float("-inf")
    return (-reward, key_order(side.rollout_n))


def _window(conv: list[Turn], div: Divergence) -> list[int]:
    if div.response_offset is None:
        ids = _prompt(conv)
        return ids[div.token_offset : div.token_offset + PREVIEW_TOKENS]
    ids = _response(conv)
    return ids[div.response_offset : div.response_offset + PREVIEW_TOKENS]


def diff_group(
    run: Run, traj: Trajectory, decoder: BatchDecoder | None = None, selection: Any = None
) -> GroupDiff:
    """Every rollout of ``traj``'s sample (same step, sample_index, split) against the best-rewarded;
    with ``selection`` (``rlreplay.read.selection.Selection``), only the rollouts it keeps."""
    if traj.sample_index is None:
        raise SelectorError(f"trajectory {traj.id[:12]} has no sample_index: it belongs to no group")
    filters = Filters(**traj.key.group().as_dict())
    group = run.trajectories(filters)
    texts = None
    if selection is not None and selection.grep is not None:
        from rlreplay.read.search import TextSearch

        texts = TextSearch(run, decoder) if decoder is not None else TextSearch.for_run(run)
    ids = (selection.apply(group, texts=texts) if selection is not None else group)["id"].to_pylist()
    if not ids:
        raise SelectorError(f"the selection leaves none of the {group.num_rows} rollouts of this group")
    members = run.load(ids, filters)
    convs = [turns(t, adapter=_adapter(run)) for t in members]
    sides = [_side(t, c, run) for t, c in zip(members, convs)]
    order = sorted(range(len(members)), key=lambda i: _reward_rank(sides[i]))
    best = order[0]
    divs = [first_divergence(convs[best], c) for c in convs]
    diverging = [i for i in order if divs[i] is not None]
    windows: list[list[int]] = []
    for i in diverging:
        windows += [_window(convs[best], divs[i]), _window(convs[i], divs[i])]  # type: ignore[arg-type]
    texts: list[Any] = decoder.decode_many(windows) if decoder is not None and windows else windows
    previews = {i: (texts[2 * k], texts[2 * k + 1]) for k, i in enumerate(diverging)}
    out: list[GroupMember] = []
    for i in order:
        member = GroupMember(sides[i], divs[i], best=i == best)
        if i in previews:
            member.preview_best, member.preview = previews[i]
        out.append(member)
    return GroupDiff(
        traj.step, traj.sample_index, traj.validate, members[best].id, out, {t.id: t for t in members}
    )
