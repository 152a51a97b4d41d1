"""``compare`` of a run and its replay calls a pair *same* exactly when the replay got each value
bit for bit: floats by their bits (NaN payloads, ``-0.0``, subnormals, ±inf), ints apart from floats
and bools, tuples apart from lists, and outputs recorded truncated (over 4 MiB) by their whole
content, not their preview.

Real runs: ``rlreplay record`` of ``tests/value_job.py``, ``rlreplay replay`` of it, ``rlreplay
compare --json``; and, for the property over the value class, runs recorded in this process. The
expected verdict is worked out here from the values' bits (``test_payload_fidelity.bits``).
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import rlreplay_proc

import rlreplay
from rlreplay.compare import compare_runs

sys.path.insert(0, str(Path(__file__).parents[1] / "format"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from test_payload_fidelity import FLOATS, INTS, bits
from value_job import NAME, encode

sys.path.insert(0, str(Path(__file__).parents[1] / "recorder"))
from test_replay_fidelity import record  # each reply from a model call of its own trajectory

JOB = Path(__file__).resolve().parents[1] / "value_job.py"
#: Over the 4 MiB a field is kept whole: recorded as a ``truncated`` marker.
BIG = (4 << 20) + 64


def f64(raw: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", raw))[0]


NAN, INF = float("nan"), float("inf")
LOG_PROBS = [-0.5] * 63  # with one more value, a list kept in the typed log-prob column
#: (what the job returned when recorded, what it returns in the replay)
PAIRS: list[tuple[Any, Any]] = [
    (NAN, float("nan")),  # another NaN object of the same bits
    (NAN, f64(0x7FF8000000000001)),  # another payload
    (NAN, -NAN),
    (f64(0x7FF0000000000001), f64(0x7FF0000000000001)),  # a signalling NaN
    (INF, INF),
    (INF, -INF),
    (-INF, -INF),
    (0.0, -0.0),
    (-0.0, -0.0),
    (5e-324, 5e-324),
    (5e-324, 0.0),
    (1.0, 1),
    (1, True),
    (2**64, 2**64),
    (2**70, 2**70 + 1),
    (b"\x00\xff", b"\x00\xff"),
    (b"\x00\xff", b"\x00\xfe"),
    ({"x": [1.0, -0.0]}, {"x": [1.0, 0.0]}),
    ({"x": [1.0, NAN]}, {"x": [1.0, float("nan")]}),
    ({"log_probs": [NAN, *LOG_PROBS]}, {"log_probs": [float("nan"), *LOG_PROBS]}),
    ({"log_probs": [-0.0, *LOG_PROBS]}, {"log_probs": [0.0, *LOG_PROBS]}),
    ("x" * BIG, "x" * BIG),  # the whole output over the limit
    ("x" * BIG + "a", "x" * BIG + "b"),  # same size, same preview, not the same
    ({"text": "y" * BIG, "n": 1}, {"text": "y" * BIG, "n": 1}),  # one field over the limit
    ({"text": "y" * BIG + "a", "n": 1}, {"text": "y" * BIG + "b", "n": 1}),
]


def truncated(value: Any) -> bool:
    return (isinstance(value, str) and len(value) > BIG - 1) or (isinstance(value, dict) and "text" in value)


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return rlreplay_proc(*args, cwd=cwd, env=env, check=True)


def verdicts(cwd: Path, run_a: Path, run_b: Path) -> dict[int, bool]:
    """sample_index -> whether ``compare --json`` calls the pair same."""
    out = cli(cwd, "compare", str(run_a), str(run_b), "--json").stdout
    return {p["sample_index"]: p["same"] for p in map(json.loads, out.splitlines())}


def test_compare_of_a_run_and_its_replay_says_same_only_for_values_got_bit_for_bit(tmp_path: Path) -> None:
    config = tmp_path / "values.json"
    config.write_text(json.dumps({"values": [{"a": encode(a), "b": encode(b)} for a, b in PAIRS]}))
    job = ("--", sys.executable, str(JOB), str(config))
    source = tmp_path / "src"
    cli(tmp_path, "record", "--framework", "generic", "--out", str(source), *job)

    # served from the recording (outputs kept whole), live for the truncated ones: the same values
    cli(tmp_path, "replay", str(source), "--out", str(tmp_path / "same"), *job)
    rows = {
        r["sample_index"]: r
        for r in map(json.loads, cli(tmp_path, "ls", "same", "--json").stdout.splitlines())
    }
    for i, (a, _) in enumerate(PAIRS):
        assert rows[i]["replay"] == ("diverged" if truncated(a) else "served")
    assert verdicts(tmp_path, source, tmp_path / "same") == dict.fromkeys(range(len(PAIRS)), True)

    # the engine down: what was not served is an error, never "same"
    down = {"VALUE_JOB_ENGINE_DOWN": "1"}
    cli(tmp_path, "replay", str(source), "--out", str(tmp_path / "down"), *job, env=down)
    expected = {i: not truncated(a) for i, (a, _) in enumerate(PAIRS)}
    assert verdicts(tmp_path, source, tmp_path / "down") == expected

    # every model call live, answered with side b: same exactly where b has a's bits
    other = {"VALUE_JOB_SIDE": "b"}
    cli(tmp_path, "replay", str(source), "--serve", "tool", "--out", str(tmp_path / "live"), *job, env=other)
    expected = {i: bits(a) == bits(b) for i, (a, b) in enumerate(PAIRS)}
    assert verdicts(tmp_path, source, tmp_path / "live") == expected


SCALARS = FLOATS | INTS | st.booleans() | st.none() | st.text(max_size=4) | st.binary(max_size=4)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
    ),
    max_leaves=12,
)


def near(value: Any) -> st.SearchStrategy:
    """``value`` again (floats made anew from their bits), or one leaf changed in a small way."""
    cls = type(value)
    if cls is float:
        raw = struct.unpack("<Q", struct.pack("<d", value))[0]
        return st.sampled_from([raw, raw ^ (1 << 63), raw ^ 1, raw ^ (1 << 51)]).map(f64) | st.just(
            int(value) if value.is_integer() else value
        )
    if cls is int and not isinstance(value, bool):
        return st.sampled_from([value, value + 1, float(value) if abs(value) < 2**53 else value, value == 1])
    if cls in (list, tuple):  # of the same JSON form either way: a tuple is not a list
        items = st.tuples(*(near(v) for v in value)) if value else st.just(())
        return items.map(list) | items.map(tuple)
    if cls is dict:
        in_order = list(value)  # the keys in a's order (compare, like ==, does not weigh the order)
        return st.fixed_dictionaries({k: near(v) for k, v in value.items()}).map(
            lambda d: {k: d[k] for k in in_order}
        )
    return st.just(value)


PAIR = VALUES.flatmap(lambda a: st.tuples(st.just(a), near(a)))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.lists(PAIR, min_size=1, max_size=6))
def test_compare_calls_a_pair_same_exactly_when_its_values_have_the_same_bits(pairs: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_a, run_b = Path(tmp) / "a", Path(tmp) / "b"
        record(run_a, [a for a, _ in pairs])
        record(run_b, [b for _, b in pairs])
        expected = [bits(a) == bits(b) for a, b in pairs]
        for fast in (True, False):
            found = list(compare_runs(rlreplay.open_run(run_a), rlreplay.open_run(run_b), fast=fast))
            assert [p.same for p in sorted(found, key=lambda p: p.sample_index)] == expected, fast
            for p in found:
                assert p.same or p.first_difference["name"] in (NAME, "trajectory")


def test_a_tuple_where_a_list_was_is_named_with_its_path_and_both_types(tmp_path: Path) -> None:
    record(tmp_path / "a", [{"x": [1, (2, 3)]}, (4,)])
    record(tmp_path / "b", [{"x": [1, [2, 3]]}, [4]])
    for fast in (True, False):
        found = compare_runs(rlreplay.open_run(tmp_path / "a"), rlreplay.open_run(tmp_path / "b"), fast=fast)
        differences = [p.first_difference for p in sorted(found, key=lambda p: p.sample_index)]
        got = [(d["name"], d["field"], d["path"], d["a"], d["b"]) for d in differences]
        assert got == [
            (NAME, "output_type", "x[1]", '"builtins.tuple"', '"builtins.list"'),
            (NAME, "output_type", None, '"builtins.tuple"', '"builtins.list"'),
        ], fast
