"""A shard whose writer is SIGKILLed mid-step: every batch whose write returned is readable and sealable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq

import rlreplay
from rlreplay.cli.main import main
from rlreplay.shards.layout import list_files
from rlreplay.shards.live import read_partial

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import pyarrow as pa
    from rlreplay.format import manifest
    from rlreplay.format.schema import SPAN_SCHEMA
    from rlreplay.shards.layout import partition_dir
    from rlreplay.shards.live import PartialWriter

    run = Path(sys.argv[1])
    manifest.ensure_manifest(run, "crash")
    writer = PartialWriter(partition_dir(run, 7, "w0"))
    for b in range(10_000):
        rows = [
            {"trajectory_id": f"{b:032x}", "span_id": f"{b * 100 + i:016x}", "parent_id": None,
             "name": "op", "kind": "op", "start_ns": i, "end_ns": i + 1, "status": "ok", "step": 7,
             "sample_index": b, "rollout_n": i, "validate": False, "worker": "w0",
             "inputs": '{"prompt_ids": [' + ",".join(str(x) for x in range(b, b + 500)) + "]}"}
            for i in range(20)
        ]
        writer.write(pa.RecordBatch.from_pylist(rows, schema=SPAN_SCHEMA))
        print(b, flush=True)  # acknowledged: the write returned
        time.sleep(0.01)
    """
)


def _kill_mid_step(run_dir: Path, acks_wanted: int = 15) -> int:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    acked = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        acked = int(line)
        if acked >= acks_wanted:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_sigkilled_writer_is_recovered(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    acked = _kill_mid_step(run_dir)
    sealed, partials = list_files(run_dir)
    assert sealed == [] and len(partials) == 1

    # Readable live, before any recovery: every acknowledged batch is there.
    live = rlreplay.open_run(run_dir).spans(step=7)
    batches = set(live["sample_index"].to_pylist())
    assert set(range(acked + 1)) <= batches
    assert live.num_rows == 20 * len(batches)

    assert main(["recover", str(run_dir)]) == 0
    assert "recovered 1 shard (" in capsys.readouterr().out
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) == 1
    meta = pq.read_schema(sealed[0]).metadata
    assert meta[b"rlreplay.recovered"] == b"true"
    table = pq.read_table(sealed[0])
    assert set(range(acked + 1)) <= set(table["sample_index"].to_pylist())
    assert table["sample_index"].to_pylist() == sorted(table["sample_index"].to_pylist())
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["recovered_shards"] == 1
    assert manifest["recovered_spans"] == table.num_rows

    assert main(["ls", str(run_dir), "--step", "7", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == table.num_rows // 20


def test_torn_tail_stops_at_last_whole_batch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _kill_mid_step(run_dir, acks_wanted=5)
    (partial,) = list_files(run_dir)[1]
    whole = read_partial(partial)
    data = partial.read_bytes()
    cut = len(data) - 100  # inside the last batch
    partial.write_bytes(data[:cut])
    torn = read_partial(partial)
    assert torn.batches == whole.batches - 1
    assert torn.discarded_bytes > 0 and not torn.clean
    assert torn.table.equals(whole.table.slice(0, torn.table.num_rows))


def test_garbage_partial_does_not_block_the_run(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    _kill_mid_step(run_dir, acks_wanted=2)
    bad = run_dir / "spans" / "step=8" / "worker=w1" / "_part-bad.partial"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x00garbage" * 50)
    assert main(["ls", str(run_dir), "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "_part-bad.partial" in err
    assert main(["recover", str(run_dir)]) == 0
    assert "_part-bad.partial" in capsys.readouterr().out
    kept = run_dir / "_quarantine" / bad.relative_to(run_dir)  # set aside for inspection, never deleted
    assert not bad.exists() and kept.read_bytes() == b"\x00garbage" * 50
