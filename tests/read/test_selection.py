"""Choosing what to upload: per-step sampling of whole GRPO groups, status filter, sizes, budgets."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support import ROLLOUTS, TRAIN_SAMPLES, TRAIN_STEPS, VAL_ROLLOUTS, VAL_SAMPLES, VAL_STEPS

import rlreplay
from rlreplay.read import selection


@pytest.fixture(scope="module")
def table(recorded_run: Path) -> pa.Table:
    return rlreplay.open_run(recorded_run).trajectories()


def _by_group(table: pa.Table) -> dict[tuple, set[str]]:
    """(step, validate, sample_index) → trajectory ids, straight from the listing."""
    out: dict[tuple, set[str]] = defaultdict(set)
    for row in table.to_pylist():
        out[(row["step"], bool(row["validate"]), row["sample_index"])].add(row["id"])
    return out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("900MB", 900_000_000),
        ("1.5GiB", int(1.5 * 2**30)),
        ("500k", 500_000),
        ("500K", 500_000),
        ("2 KiB", 2048),
        ("1234", 1234),
        ("1234b", 1234),
        ("0.5 mb", 500_000),
        ("3T", 3 * 10**12),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert selection.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "5 XB", "-1", "1.2.3MB", "i", "MB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        selection.parse_size(text)


def test_fixture_run_shape(table: pa.Table) -> None:
    """The counts the other tests reason about, taken from the recorded files."""
    groups = _by_group(table)
    train = {k for k in groups if not k[1]}
    val = {k for k in groups if k[1]}
    assert len(train) == len(TRAIN_STEPS) * TRAIN_SAMPLES
    assert len(val) == len(VAL_STEPS) * VAL_SAMPLES
    assert all(len(groups[k]) == ROLLOUTS for k in train)
    assert all(len(groups[k]) == VAL_ROLLOUTS for k in val)


def test_max_samples_keeps_whole_groups_per_step_and_split(table: pa.Table) -> None:
    expected_groups = _by_group(table)
    chosen = selection.select(table, max_samples=2, seed=0)
    per_split: dict[tuple, list[int]] = defaultdict(list)
    for group in chosen:
        per_split[(group.step, group.validate)].append(group.sample_index)
        # every rollout of the chosen sample, and nothing else
        assert set(group.ids) == expected_groups[(group.step, group.validate, group.sample_index)]
    assert set(per_split) == {(s, False) for s in TRAIN_STEPS} | {(s, True) for s in VAL_STEPS}
    for samples in per_split.values():
        assert len(samples) == len(set(samples)) == 2
    ids = selection.group_ids(chosen)
    assert len(ids) == len(set(ids)) == (len(TRAIN_STEPS) * 2 * ROLLOUTS + len(VAL_STEPS) * 2 * VAL_ROLLOUTS)
    # upload order: by step, training before validation
    keys = [(g.step, g.validate) for g in chosen]
    assert keys == sorted(keys)


def test_choice_is_seeded_and_reproducible(table: pa.Table) -> None:
    def choice(seed: int) -> list[tuple]:
        return [
            (g.step, g.validate, g.sample_index) for g in selection.select(table, max_samples=2, seed=seed)
        ]

    assert choice(3) == choice(3)
    assert len({tuple(choice(seed)) for seed in range(8)}) > 1
    # a reversed table gives the same choice: it depends on the seed, not on row order
    reversed_table = table.take(pa.array(range(table.num_rows - 1, -1, -1)))
    assert choice(5) == [
        (g.step, g.validate, g.sample_index) for g in selection.select(reversed_table, max_samples=2, seed=5)
    ]


def test_choice_does_not_depend_on_other_steps(recorded_run: Path, table: pa.Table) -> None:
    """Filtering to one step (``--step 2``) picks the same samples as the whole run does at step 2."""
    only_step = rlreplay.open_run(recorded_run).trajectories(step=2)
    from_whole = [g.sample_index for g in selection.select(table, max_samples=2, seed=1) if g.step == 2]
    from_step = [g.sample_index for g in selection.select(only_step, max_samples=2, seed=1)]
    assert from_whole == from_step


def test_all_and_none(table: pa.Table) -> None:
    everything = selection.select(table)
    assert sorted(selection.group_ids(everything)) == sorted(table["id"].to_pylist())
    assert selection.select(table, max_samples=0) == []
    more_than_there_are = selection.select(table, max_samples=1000)
    assert sorted(selection.group_ids(more_than_there_are)) == sorted(table["id"].to_pylist())
    with pytest.raises(ValueError):
        selection.select(table, max_samples=-1)


def test_status_filter(table: pa.Table) -> None:
    rows = table.to_pylist()
    failed = {r["id"] for r in rows if r["status"] == "error"}
    ok = {r["id"] for r in rows if r["status"] == "ok"}
    assert failed and ok
    assert set(selection.group_ids(selection.select(table, status="error"))) == failed
    assert set(selection.group_ids(selection.select(table, status="ok"))) == ok
    with pytest.raises(ValueError):
        selection.select(table, status="maybe")


def test_trajectories_without_sample_index_are_groups_of_one() -> None:
    table = pa.table(
        {
            "id": ["a", "b", "c", "d"],
            "step": [1, 1, 1, 0],
            "validate": [False, False, None, False],
            "sample_index": [None, None, 4, None],
            "status": ["ok"] * 4,
        }
    )
    chosen = selection.select(table, max_samples=5)
    assert sorted(len(g.ids) for g in chosen) == [1, 1, 1, 1]
    assert [g.step for g in chosen] == [0, 1, 1, 1]  # step order
    assert len(selection.select(table, max_samples=1)) == 2  # one per (step, split)


# --- one grammar, whatever says which trajectories ------------------------------------------------

_KEYS = ("step", "sample_index", "rollout_n")


def _mixed_listing(rng: random.Random, n: int = 400) -> tuple[pa.Table, list[dict]]:
    """A listing whose keys mix ints and strings (``"12"`` beside 12), as a run stores them: an int
    column and a ``_str`` twin per key; and the rows as recorded (one value per key)."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "id": f"{i:032x}",
                "step": rng.choice([0, 1, 2, 3, -1, None]),
                "sample_index": rng.choice([0, 1, 2, 7, 12, "12", "s1-3", "a", None]),
                "rollout_n": rng.choice([0, 1, 2, "2", "r", None]),
                "validate": rng.random() < 0.3,
                "experiment": rng.choice(["e1", "e2"]),
                "status": "ok",
            }
        )
    columns: dict[str, list] = {"id": [r["id"] for r in rows]}
    for key in _KEYS:
        columns[key] = [r[key] if isinstance(r[key], int) else None for r in rows]
        columns[f"{key}_str"] = [r[key] if isinstance(r[key], str) else None for r in rows]
    for name in ("validate", "experiment", "status"):
        columns[name] = [r[name] for r in rows]
    types = {**{k: pa.int64() for k in _KEYS}, **{f"{k}_str": pa.string() for k in _KEYS}}
    return pa.table({k: pa.array(v, type=types.get(k)) for k, v in columns.items()}), rows


def _items(rng: random.Random, strings: bool) -> list[tuple[str, Any]]:
    """Items of a key filter as a person types them, with what each matches."""
    out = []
    for _ in range(rng.randint(1, 3)):
        pick = rng.random()
        if pick < 0.45:
            n = rng.randint(-1, 13)
            out.append((str(n), ("int", n)))
        elif pick < 0.75:
            lo = rng.randint(-2, 8)
            hi = lo + rng.randint(0, 5)
            out.append((f"{lo}..{hi}", ("range", lo, hi)))
        elif strings:
            text = rng.choice(["s1-3", "a", "r", "nope"])
            out.append((text, ("text", text)))
    return out


def _matches(value: Any, items: list[tuple[str, Any]]) -> bool:
    """The rule, written out: an int item names that int and the string of its digits, a range
    the ints in it, other text the string as written; nothing matches a missing value."""
    for text, item in items:
        if item[0] == "int" and (value == item[1] if isinstance(value, int) else value == text):
            return True
        if item[0] == "range" and isinstance(value, int) and item[1] <= value <= item[2]:
            return True
        if item[0] == "text" and value == item[1]:
            return True
    return False


def test_options_selectors_and_urls_select_the_same_in_a_run_whose_keys_mix_ints_and_strings() -> None:
    """Seeded random selections over a listing of mixed keys: the Selection made from options,
    from a ``show``/``diff`` selector and from URL parameters keeps exactly the rows the rule
    written out here keeps (the UI once failed on such runs: int64 compared with a string)."""
    from rlreplay.read.selection import Selection

    rng = random.Random(37)
    table, rows = _mixed_listing(rng)
    for _ in range(300):
        chosen: dict[str, Any] = {}
        wanted: dict[str, list] = {}
        for key in _KEYS:
            if rng.random() < 0.5:
                items = _items(rng, strings=key != "step")
                if items:
                    chosen[key], wanted[key] = ",".join(t for t, _ in items), items
        validate = rng.choice([None, True, False])
        experiment = rng.choice([None, "e1", "e2", "e3"])
        expected = [
            r["id"]
            for r in rows
            if all(_matches(r[k], wanted[k]) for k in wanted)
            and (validate is None or r["validate"] == validate)
            and (experiment is None or r["experiment"] == experiment)
        ]
        options = Selection(**chosen, validate=validate, experiment=experiment)
        assert options.apply(table)["id"].to_pylist() == expected, (chosen, validate, experiment)
        params = {**chosen, "experiment": experiment or ""}
        if validate is not None:
            params["split"] = "val" if validate else "train"  # an older link's name
        assert Selection.from_params(params).apply(table)["id"].to_pylist() == expected
        if all("," not in text for text in chosen.values()):  # a selector gives one item a key
            pairs = [f"{k}={v}" for k, v in chosen.items()]
            pairs += [f"validate={str(validate).lower()}"] if validate is not None else []
            pairs += [f"exp={experiment}"] if experiment is not None else []
            if pairs:
                parsed = Selection.parse(",".join(pairs))
                assert parsed.apply(table)["id"].to_pylist() == expected, pairs
