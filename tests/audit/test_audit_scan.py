"""The audit's fast paths give the findings of the plain ones: trajectories streamed a step at a time
(the built-in checks over each step's model, tool and parser spans alone) against each whole
trajectory read on its own, and the vectorised repetition and garbled-text rules against the
rules written out plainly here."""

from __future__ import annotations

import random
import unicodedata
from dataclasses import replace
from typing import Any

import numpy as np
from support import qwen_tokenizer_dir
from test_audit import planted_run  # noqa: F401  (the planted run fixture)

import rlreplay
from rlreplay.adapters.registry import adapter_for_run
from rlreplay.audit import engine
from rlreplay.audit.calls import _least_run, _loop, _may_loop, garbled_reasons
from rlreplay.audit.finding import LEVEL_TRAJECTORY, OVER_LISTING, OVER_TRAJECTORIES, Check, Context
from rlreplay.text.token2text import Decoder


def test_a_streamed_audit_finds_what_each_trajectory_read_alone_gives(planted_run) -> None:  # noqa: F811
    run_dir, plans, _ = planted_run
    run = rlreplay.open_run(run_dir)
    listing = run.trajectories()
    checks = [c for c in engine.available().values() if c.over != OVER_LISTING]
    report = engine.audit(run, listing, checks)
    assert not report.skipped
    ctx = Context(engine.default_thresholds(checks), adapter_for_run(run), Decoder.load(run.tokenizer))
    expected = []
    for tid, step in zip(listing["id"].to_pylist(), listing["step"].to_pylist()):
        (traj,) = run.load([tid])
        assert traj.step == step
        expected.extend(engine.check_trajectory(traj, checks, ctx))
    assert [f.to_dict() for f in report.findings] == [f.to_dict() for f in expected]
    names = {c.name for c in checks}
    planted = {(check, p.key) for p in plans for check, _ in p.planted if check in names}
    assert {(f.check, (f.step, f.sample_index, f.rollout_n)) for f in expected} == planted


def plain_loop(ids: list[int], max_ngram: int) -> tuple[int, int, int] | None:
    """The longest stretch repeating one n-gram, n by n: (n, repeats, start)."""
    best = None
    for n in range(1, min(max_ngram, len(ids) // 2) + 1):
        run_start, run_len, top = 0, 0, None
        for j in range(len(ids) - n):
            if ids[j + n] == ids[j]:
                if run_len == 0:
                    run_start = j
                run_len += 1
                if top is None or run_len > top[0]:
                    top = (run_len, run_start)
            else:
                run_len = 0
        if top is not None and top[0] + n >= 2 * n and (best is None or top[0] + n > best[0]):
            best = (top[0] + n, n, top[1])
    return None if best is None else (best[1], best[0] // best[1], best[2])


def random_ids(rng: random.Random, size: int, gram: int, times: int) -> list[int]:
    """Up to ``size`` ids from a small or large vocabulary, half the time with an n-gram (up to
    ``gram`` ids) repeated up to ``times`` times put in somewhere."""
    vocab = rng.choice([2, 3, 7, 1000])
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, size))]
    if ids and rng.random() < 0.5:
        loop = [rng.randrange(vocab) for _ in range(rng.randrange(1, gram))]
        at = rng.randrange(len(ids))
        ids = ids[:at] + loop * rng.randrange(1, times) + ids[at:]
    return ids


def test_the_repetition_rule_matches_its_plain_form() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        ids = random_ids(rng, 120, 9, 12)
        max_ngram = rng.choice([1, 3, 32])
        assert _loop(ids, max_ngram) == plain_loop(ids, max_ngram), (ids, max_ngram)


def plain_garbled(text: str, ctx: Any) -> list[str]:
    reasons = []
    bad = text.count("\ufffd")
    if bad >= ctx["garbled_replacements"]:
        reasons.append(f"{bad} replacement characters")
    control = sum(1 for c in text if unicodedata.category(c) in ("Cc", "Cs", "Co") and c not in "\n\r\t")
    if control >= ctx["garbled_controls"]:
        reasons.append(f"{control} control characters")
    scripts: dict[str, int] = {}
    same = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK"}
    known = {"LATIN", "CJK", "HIRAGANA", "KATAKANA", "HANGUL", "CYRILLIC", "GREEK", "ARABIC", "HEBREW"}
    known |= {"DEVANAGARI", "THAI", "ARMENIAN", "GEORGIAN", "ETHIOPIC", "TAMIL", "BENGALI"}
    for c in text:
        if c.isalpha():
            word = unicodedata.name(c, "UNKNOWN").split(" ")[0]
            script = same.get(word, word) if word in known else word
            scripts[script] = scripts.get(script, 0) + 1
    mixed = sorted(s for s, count in scripts.items() if count >= ctx["garbled_script_letters"])
    if len(mixed) >= ctx["garbled_scripts"]:
        reasons.append(f"{len(mixed)} scripts mixed ({', '.join(s.lower() for s in mixed)})")
    return reasons


def test_the_garbled_rule_matches_its_plain_form() -> None:
    ctx = Context(engine.default_thresholds([engine.available()["garbled"]]))
    pieces = [
        "the answer is 42. ",
        "\ufffd",
        "\x07",
        "\x00",
        "\ue000",
        "Привет ",
        "こんにちは",
        "한국어",
        "αβγ",
    ]
    pieces += ["שלום", "مرحبا", "\n\t", "ǅ", "\U000f0000", "漢字", "ไทย"]
    rng = random.Random(1)
    for _ in range(800):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
        assert garbled_reasons(text, ctx) == plain_garbled(text, ctx), repr(text)
    assert np.any([bool(garbled_reasons("\ufffd\ufffd" + p, ctx)) for p in pieces])


def over_whole_trajectories(run_dir: Any) -> tuple[list[dict], list[dict]]:
    """Every trajectory check's findings as ``audit`` gives them, and those of the same rules each
    given whole trajectories (as a plug-in check without ``span_kinds`` is)."""
    run = rlreplay.open_run(run_dir)
    listing = run.trajectories()
    checks = [c for c in engine.available().values() if c.over != OVER_LISTING]
    assert all(c.span_kinds for c in checks)
    fast = engine.audit(run, listing, checks)
    whole = engine.audit(run, listing, [replace(c, span_kinds=None) for c in checks])
    assert not fast.skipped and not whole.skipped
    return [f.to_dict() for f in fast.findings], [f.to_dict() for f in whole.findings]


def test_checks_over_calls_alone_find_what_whole_trajectories_give(planted_run) -> None:  # noqa: F811
    fast, whole = over_whole_trajectories(planted_run[0])
    assert fast == whole
    assert {f["check"] for f in whole} >= {"retokenization", "repetition", "garbled", "tool_error"}


def test_a_plug_in_check_gets_whole_trajectories(planted_run) -> None:  # noqa: F811
    run_dir = planted_run[0]
    got: list[Any] = []

    def keep(traj: Any, ctx: Any) -> list:
        got.append(traj)
        return []

    plug_in = Check("mine", OVER_TRAJECTORIES, LEVEL_TRAJECTORY, "what it flags", keep)
    run = rlreplay.open_run(run_dir)
    listing = run.trajectories()
    builtin = [c for c in engine.available().values() if c.over != OVER_LISTING]
    with_it = engine.audit(run, listing, [*builtin, plug_in])
    alone = engine.audit(run, listing, builtin)
    assert [f.to_dict() for f in with_it.findings] == [f.to_dict() for f in alone.findings]
    assert sorted(t.id for t in got) == sorted(listing["id"].to_pylist())
    for traj in got:
        (whole,) = run.load([traj.id])
        assert [s.to_dict() for s in traj.spans] == [s.to_dict() for s in whole.spans]
        assert {s.kind for s in traj.spans} - {"llm", "tool", "parser"}  # more than the calls
        assert any(s.children for s in traj.spans)  # and the tree


def test_the_repetition_screen_passes_every_response_the_rule_flags() -> None:
    rng = random.Random(2)
    screened = 0
    for _ in range(3000):
        ids = random_ids(rng, 160, 12, 14)
        max_ngram, repeats, tokens = rng.choice([1, 3, 32]), rng.choice([2, 4, 6.5]), rng.choice([4, 16, 32])
        found = plain_loop(ids, max_ngram)
        flagged = found is not None and found[1] >= repeats and found[0] * found[1] >= tokens
        passes = _may_loop(ids, max_ngram, _least_run(max_ngram, repeats, tokens))
        assert passes or not flagged, (ids, max_ngram, repeats, tokens)
        screened += not passes and found is not None
    assert screened > 100  # the screen turns away responses the full rule would have looked at


def test_ids_sure_to_be_printable_ascii_decode_to_it() -> None:
    decoder = Decoder.load(str(qwen_tokenizer_dir()))
    tok = decoder._tok
    rng = random.Random(3)
    size = tok.get_vocab_size(with_added_tokens=True)
    plain = tok.encode("def add(x, y):\n\treturn x + y  # the sum\r\n").ids
    other = tok.encode("naïve 漢字 Привет \x07").ids
    seqs = [
        plain,
        other,
        [],
        [size + 5],
        *([rng.randrange(size) for _ in range(rng.randrange(1, 6))] for _ in range(3000)),
    ]
    seqs += [[rng.choice(plain + other) for _ in range(rng.randrange(1, 40))] for _ in range(3000)]
    sure = decoder.printable_ascii(seqs, skip_special_tokens=True)
    for seq, is_sure in zip(seqs, sure):
        if is_sure:
            text = tok.decode(seq, skip_special_tokens=True)
            assert text.isascii() and all(c.isprintable() or c in "\n\r\t" for c in text), (seq, text)
    assert sure[0] and not sure[1] and sure[2] and not sure[3]
    assert 100 < sum(sure) < len(seqs) - 100


def test_an_adapter_reading_calls_its_own_way_gets_whole_trajectories(planted_run, monkeypatch) -> None:  # noqa: F811
    from rlreplay.adapters import generic, registry

    run = rlreplay.open_run(planted_run[0])
    listing = run.trajectories()
    checks = [c for c in engine.available().values() if c.over != OVER_LISTING]
    expected = [f.to_dict() for f in engine.audit(run, listing, checks).findings]
    responses: list[Any] = []

    class Mine(generic.GenericAdapter):
        def stop_reason(self, span: Any) -> str | None:
            responses.append(self.call_ids(span)[1])
            return super().stop_reason(span)

    monkeypatch.setattr(registry, "adapter_for_run", lambda run: Mine())
    assert [f.to_dict() for f in engine.audit(run, listing, checks).findings] == expected
    assert any(r is not None and len(r) >= 64 for r in responses)
    assert all(r is None or isinstance(r, list) for r in responses)  # as whole trajectories hold them
