"""How small can float32 log-probs be stored without changing a bit? Side by side, per value:
format 2's encoding (byte-stream-split + zstd at the sealed level), the same at zstd 19, and the
information-theoretic floor of the values' distribution (no lossless coder can go below it).

Sources: the rollout log-probs of the shipped real verl run (SmolLM2-135M through verl's agent
loop: few, and repeating, so no floor is estimated for them); the half-normal log-probs
``bench_scale.py`` records (sigma 1.2) as drawn, and after the float32 log-softmax step a server
applies (``x - logsumexp``: a multiple of the ulp of ``logsumexp``).

    .venv/bin/python benchmarks/bench_logprob_bytes.py [--values 500000]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.shards.seal import SEALED_ZSTD_LEVEL

REAL_RUN = Path(__file__).parent.parent / "sample_runs" / "verl-toolagent-smollm2"


def stored_bytes(values: np.ndarray, level: int) -> float:
    buf = io.BytesIO()
    table = pa.table({"v": pa.array(values, pa.float32())})
    pq.write_table(
        table,
        buf,
        compression="zstd",
        compression_level=level,
        use_dictionary=False,
        use_byte_stream_split=["v"],
    )
    return len(buf.getvalue()) / len(values)


def floor_bytes(values: np.ndarray, step: float | None = None) -> float:
    """Entropy in bytes per value of i.i.d. draws from the values' distribution, coded as float32
    (or on a grid of ``step``): differential entropy (histogram estimate) minus the mean log2 of
    the coding resolution at each value."""
    x = np.abs(values[values != 0].astype(np.float64))
    logs = np.log2(x)
    edges = np.linspace(logs.min(), logs.max(), 400)  # density of log2|x|: h(X) = h(log2|x|) + E[log2|x|]
    counts, _ = np.histogram(logs, edges)
    p = counts[counts > 0] / counts.sum()
    width = edges[1] - edges[0]
    h_log = -(p * np.log2(p / width)).sum()
    h = h_log + logs.mean() + np.log2(np.log(2))
    resolution = np.floor(logs) - 23 if step is None else np.maximum(np.floor(logs) - 23, np.log2(step))
    return float(h - resolution.mean()) / 8


def real_logprobs() -> np.ndarray:
    values: list[float] = []
    for path in sorted(REAL_RUN.glob("spans/step=*/worker=*/*.parquet")):
        table = pq.read_table(path, columns=["name", "token_logprobs"])
        for name, lp in zip(table["name"].to_pylist(), table["token_logprobs"].to_pylist()):
            if lp and name.endswith("generate"):
                values += lp
    return np.asarray(values, dtype=np.float32)


def through_log_softmax(true: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    lse = rng.uniform(16, 32, len(true)).astype(np.float32)  # logsumexp of a real model's logits
    logits = (lse.astype(np.float64) + true).astype(np.float32)
    return (logits - lse).astype(np.float32), 2.0**-19  # ulp of [16, 32) in float32


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--values", type=int, default=500_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    real = real_logprobs()
    synthetic = (-np.abs(rng.normal(0, 1.2, args.values))).astype(np.float32)
    rows = [
        (f"real verl rollout log-probs ({len(real):,})", real, None),
        ("bench_scale's half-normal, as drawn", synthetic, None),
        ("bench_scale's half-normal through float32 log-softmax", *through_log_softmax(synthetic, rng)),
    ]
    header = f"format 2 (BSS + zstd {SEALED_ZSTD_LEVEL}) | BSS + zstd 19 | floor (entropy) | format 2 / floor"
    print(f"| log-probs | {header} |")
    print("|---|---:|---:|---:|---:|")
    for label, values, step in rows:
        ours, best = stored_bytes(values, SEALED_ZSTD_LEVEL), stored_bytes(values, 19)
        distinct = len(np.unique(values.view(np.uint32)))
        if step is None and distinct < 0.9 * len(values):  # repeats: no continuous distribution's draws
            print(f"| {label}, {distinct:,} distinct | {ours:.2f} B | {best:.2f} B | (values repeat) | |")
            continue
        floor = floor_bytes(values, step)
        print(f"| {label} | {ours:.2f} B | {best:.2f} B | {floor:.2f} B | {ours / floor:.2f}x |")


if __name__ == "__main__":
    main()
