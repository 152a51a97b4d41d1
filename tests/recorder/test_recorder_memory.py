"""Sealing a live file reads it in place (mapped) and holds one row group at a time: neither a copy
of the file's batches nor a sorted or combined copy of them. Measured as Arrow's peak allocation
in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq

WRITE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    from rlreplay.recorder.rows import StepBuffer
    from rlreplay.format.schema import SPAN_SCHEMA
    from rlreplay.shards.live import PartialWriter

    rng = np.random.default_rng(0)
    writer = PartialWriter(Path(sys.argv[1]))
    inputs = SPAN_SCHEMA.names.index("inputs")
    for b in range(24):
        buf = StepBuffer()
        for i in range(50):
            row = [None] * len(SPAN_SCHEMA)
            row[:15] = [f"{int(rng.integers(1 << 62)):032x}", f"{b}-{i}", None, "generate", "llm", 1, 2,
                        "ok", None, "w", "e", False, 0, int(rng.integers(100)), i % 4]
            row[inputs] = '{"x":"' + "y" * 200 + '"}'
            row[-3] = rng.integers(0, 151_000, 2000).astype(np.int32)
            row[-1] = rng.normal(size=2000).astype(np.float32)
            buf.append(tuple(row), 0)
        writer.write(buf.take_batch()[0])
    writer.close()
    print(json.dumps({"path": str(writer.path), "nbytes": writer.nbytes, "rows": writer.rows}))
    """
)

SEAL = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import pyarrow as pa
    from rlreplay.shards.seal import seal, sealing_pool

    result = seal(Path(sys.argv[1]))
    pools = {pool.backend_name: pool for pool in (pa.default_memory_pool(), sealing_pool())}
    peak = sum(pool.max_memory() for pool in pools.values())  # at most this at once
    sealing_peak = sealing_pool().max_memory()
    print(json.dumps({"peak": peak, "sealing_pool_peak": sealing_peak, "sealed": str(result.sealed)}))
    """
)


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sealing_holds_a_row_group_not_the_live_file(tmp_path: Path) -> None:
    written = _run(WRITE, str(tmp_path / "spans" / "step=0" / "worker=w"))
    assert written["nbytes"] > 15 << 20
    sealed = _run(SEAL, written["path"])
    # before: the batches read into memory and combined once (~2.2x), and a sorted copy before that
    assert sealed["peak"] <= 0.6 * written["nbytes"]
    assert sealed["sealing_pool_peak"] > 0  # where the row groups are gathered and encoded
    table = pq.read_table(sealed["sealed"])
    assert table.num_rows == written["rows"]
    keys = list(zip(table["sample_index"].to_pylist(), table["rollout_n"].to_pylist()))
    assert keys == sorted(keys)
    assert not Path(written["path"]).exists()
