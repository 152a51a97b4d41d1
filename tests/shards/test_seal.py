"""Sealing a live file: its rows sorted, gathered a row group at a time from the batches as they were
written (spans of many trajectories interleaved, in the order they ended), and the file read in place
(mapped, not copied)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.recorder.rows import StepBuffer
from rlreplay.shards.live import PartialWriter, read_partial
from rlreplay.shards.seal import SORT_KEYS, seal

_INPUTS = SPAN_SCHEMA.names.index("inputs")
_TOKENS = {name: SPAN_SCHEMA.names.index(name) for name in ("token_ids", "token_masks", "token_logprobs")}


def _row(rng: random.Random, trajectory: int, span: int) -> tuple:
    row: list = [None] * len(SPAN_SCHEMA)
    ids = [f"{trajectory:032x}", f"{trajectory:08x}{span:08x}", None, "generate", "llm"]
    row[:15] = [
        *ids,
        rng.randrange(1 << 40),
        0,
        "ok",
        None,
        "w",
        "e",
        False,
        0,
        trajectory % 7,
        trajectory % 3,
    ]
    row[_INPUTS] = '{"n": ' + str(rng.randrange(10**6)) + "}"
    n = rng.randrange(0, 300)
    row[_TOKENS["token_ids"]] = np.array([rng.randrange(151_000) for _ in range(n)], dtype=np.int32)
    row[_TOKENS["token_logprobs"]] = np.array([-rng.random() for _ in range(n // 2)], dtype=np.float32)
    if rng.random() < 0.3:
        row[_TOKENS["token_masks"]] = np.ones(n, dtype=np.int8)
    return tuple(row)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 40), st.integers(1, 12), st.integers(1, 30))
def test_a_sealed_file_holds_the_live_rows_sorted(
    seed: int, trajectories: int, spans: int, per_batch: int
) -> None:
    """Whatever the interleaving and the batch sizes, the sealed shard holds exactly the live file's
    rows, sorted by key, trajectory and start: what Arrow's own sort and take give."""
    import tempfile

    rng = random.Random(seed)
    order = [(t, s) for t in range(trajectories) for s in range(rng.randrange(1, spans + 1))]
    rng.shuffle(order)  # spans end in any order
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "spans" / "step=0" / "worker=w"
        writer = PartialWriter(folder)
        rows = [_row(rng, t, s) for t, s in order]
        for start in range(0, len(rows), per_batch):
            buffer = StepBuffer()
            for row in rows[start : start + per_batch]:
                buffer.append(row, 0)
            writer.write(buffer.take_batch()[0])
        writer.close()
        written = read_partial(writer.path).table
        expected = written.take(pc.sort_indices(written, sort_keys=SORT_KEYS)).combine_chunks()
        result = seal(writer.path)
        sealed = pq.read_table(result.sealed)
    assert result.rows == len(rows)
    assert sealed.cast(SPAN_SCHEMA).equals(expected.cast(SPAN_SCHEMA))


def test_reading_a_live_file_maps_it_in_place(tmp_path: Path) -> None:
    """Sealing reads the live file it seals: its batches come from the mapped file, with no copy
    made (memory that is new to the process costs more to touch than the copy itself)."""
    rng = random.Random(1)
    writer = PartialWriter(tmp_path / "spans" / "step=0" / "worker=w")
    for b in range(24):
        buffer = StepBuffer()
        for s in range(40):
            buffer.append(_row(rng, b * 40 + s, 0), 0)
        writer.write(buffer.take_batch()[0])
    writer.close()
    assert writer.nbytes > 1 << 20
    contents = read_partial(writer.path)
    assert contents.table.num_rows == 960 and contents.clean
    mapped = _mapped_ranges(writer.path)
    assert mapped  # the file is mapped while its batches live
    for name in ("token_ids", "token_logprobs", "inputs"):
        for chunk in contents.table[name].chunks:
            values = chunk.buffers()[-1]  # the values (for lists, their children's last buffer)
            assert any(lo <= values.address and values.address + values.size <= hi for lo, hi in mapped)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (``/proc/self/maps``)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges
