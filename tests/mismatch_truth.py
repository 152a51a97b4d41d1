"""Each response's tokens read from a run's span files with pyarrow and orjson alone, for the
mismatch tests: not through rlreplay's readers. Token-array placeholders are resolved by the
format's rule, written out here from its description (``rlreplay/format/arrays.py``):

``{"__type__": "tokens", "t": dtype, "o": offset, "n": stored count, "s": stream position, "r":
[[span, start, length, at], ...]}`` takes ``n`` values of the row's typed column from ``o``; each
``r`` entry puts ``length`` values of span ``span``'s stream (all its arrays of that dtype, end to
end, in stream order) from ``start`` at position ``at``; the stored values fill the rest in order.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

COLUMN = {"i32": "token_ids", "i8": "token_masks", "f32": "token_logprobs"}


def span_rows(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted(glob.glob(str(Path(run_dir) / "spans" / "*" / "*" / "*.parquet")))
    return pa.concat_tables([pq.read_table(f) for f in files]).to_pylist()


class _Spans:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = {r["span_id"]: r for r in rows}
        self.json: dict[str, tuple[Any, Any]] = {}

    def payloads(self, span_id: str) -> tuple[Any, Any]:
        if span_id not in self.json:
            row = self.rows[span_id]
            self.json[span_id] = tuple(orjson.loads(row[k]) if row[k] else None for k in ("inputs", "output"))
        return self.json[span_id]

    def stream(self, span_id: str, dtype: str) -> np.ndarray:
        """The span's arrays of ``dtype``, end to end, in stream order."""
        found: list[tuple[int, np.ndarray]] = []

        def walk(value: Any) -> None:
            if isinstance(value, dict):
                if value.get("__type__") == "tokens":
                    if value["t"] == dtype and "s" in value:
                        found.append((value["s"], self.values(span_id, value)))
                    return
                for v in value.values():
                    walk(v)
            elif isinstance(value, list):
                for v in value:
                    walk(v)

        for part in self.payloads(span_id):
            walk(part)
        found.sort(key=lambda f: f[0])
        return np.concatenate([a for _, a in found]) if found else np.zeros(0)

    def values(self, span_id: str, placeholder: dict[str, Any]) -> np.ndarray:
        row = self.rows[span_id]
        column = np.asarray(row[COLUMN[placeholder["t"]]], dtype=np.float64)
        stored = column[placeholder["o"] : placeholder["o"] + placeholder["n"]]
        refs = placeholder.get("r") or []
        if refs and isinstance(refs[0], str):  # early format 2: one prefix
            refs = [[refs[0], refs[1], refs[2], 0]]
        total = placeholder["n"] + sum(r[2] for r in refs)
        out = np.empty(total)
        free = np.ones(total, dtype=bool)
        for span, start, length, at in refs:
            out[at : at + length] = self.stream(span, placeholder["t"])[start : start + length]
            free[at : at + length] = False
        out[free] = stored
        return out

    def array(self, span_id: str, value: Any) -> np.ndarray | None:
        if value is None:
            return None
        if isinstance(value, list):
            return np.array([np.nan if v is None else v for v in value], dtype=np.float64)
        return self.values(span_id, value)


def responses(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per trajectory id: its keys, worker and, from its agent span and its latest signals span,
    the response's ``ids``, ``mask`` (bool), ``rollout`` and ``trainer`` log-probs (float64; the
    trainer's None when not recorded) and the weights version (``max_global_steps``)."""
    rows = span_rows(run_dir)
    spans = _Spans(rows)
    by_traj: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_traj.setdefault(r["trajectory_id"], []).append(r)
    out = {}
    for tid, members in by_traj.items():
        agent = next((r for r in sorted(members, key=lambda r: r["start_ns"]) if r["kind"] == "agent"), None)
        if agent is None:
            continue
        _, output = spans.payloads(agent["span_id"])
        signals = sorted((r for r in members if r["kind"] == "signals"), key=lambda r: r["end_ns"])
        trainer = None
        for s in reversed(signals):
            _, sig = spans.payloads(s["span_id"])
            if isinstance(sig, dict) and "old_log_probs" in sig:
                trainer = spans.array(s["span_id"], sig["old_log_probs"])
                break
        root = next(r for r in members if r["kind"] != "signals")
        ids = spans.array(agent["span_id"], output["response_ids"]).astype(np.int64)
        mask = spans.array(agent["span_id"], output.get("response_mask"))
        out[tid] = {
            "step": root["step"],
            "sample_index": root["sample_index"],
            "rollout_n": root["rollout_n"],
            "validate": bool(root["validate"]),
            "worker": root["worker"],
            "ids": ids,
            "mask": np.ones(len(ids), dtype=bool) if mask is None else mask != 0,
            "rollout": spans.array(agent["span_id"], output["response_logprobs"]),
            "trainer": trainer,
            "version": ((output.get("extra_fields") or {}).get("max_global_steps")),
        }
        if "entropy" in output:
            out[tid]["entropy"] = spans.array(agent["span_id"], output["entropy"])
    return out


def padded(batch: list[dict[str, Any]]) -> tuple[Any, Any, Any]:
    """(trainer, rollout, mask) of responses as verl holds a batch: float64 tensors padded to the
    longest response (the mask 0 there)."""
    import torch

    width = max(len(r["ids"]) for r in batch)
    old = torch.zeros(len(batch), width, dtype=torch.float64)
    roll = torch.zeros(len(batch), width, dtype=torch.float64)
    mask = torch.zeros(len(batch), width, dtype=torch.float64)
    for i, r in enumerate(batch):
        n = len(r["ids"])
        old[i, :n] = torch.from_numpy(np.nan_to_num(r["trainer"][:n]))
        roll[i, :n] = torch.from_numpy(np.nan_to_num(r["rollout"][:n]))
        mask[i, :n] = torch.from_numpy(r["mask"][:n].astype(np.float64))
    return old, roll, mask
