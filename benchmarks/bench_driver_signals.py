"""Driver-step overhead of rlreplay's trainer hook: verl's compute_advantage with and without it.

The batch is shaped like the one ``RayPPOTrainer.fit`` hands to ``compute_advantage`` (GRPO):
``rows`` rollouts in groups of ``n``, ``length`` response tokens, rewards on the last token,
``old_log_probs`` and ``rollout_log_probs``, the trajectory key per row, then reordered as
``balance_batch`` does. Both variants call verl's real ``compute_advantage``; the hooked one also
computes reward, advantage and log-prob mismatch per row and queues one signals row each to a
recording rlreplay recorder. The driver's thread only takes references; the figures are computed
on rlreplay's signals thread and the rows written by the recorder's writer thread.
Each timing is the median of ``--repeat`` calls. After each hooked call the background work is
waited for (and timed separately), as it is done long before a real driver's next step: the
driver step itself (generation, old log-probs, actor update) takes seconds to minutes.

    .venv/bin/python benchmarks/bench_driver_signals.py            # 512 rows x 2,048 tokens
    .venv/bin/python benchmarks/bench_driver_signals.py --big      # 2,048 rows x 8,192 tokens
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def make_batch(rows: int, length: int, n: int, keys: list[dict]) -> Any:
    import numpy as np
    import torch
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    scores = torch.zeros(rows, length)
    scores[torch.arange(rows), lengths - 1] = (torch.rand(rows, generator=g) > 0.5).float()
    rollout = -torch.rand(rows, length, generator=g)
    keys_arr = np.empty(rows, dtype=object)
    keys_arr[:] = keys
    batch = DataProto.from_dict(
        tensors={
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones(rows, 16, dtype=torch.long), mask], 1),
            "token_level_scores": scores,
            "token_level_rewards": scores,
            "rollout_log_probs": rollout,
            "old_log_probs": rollout + torch.randn(rows, length, generator=g) * 0.01,
        },
        non_tensors={
            "uid": np.array([f"u{i // n}" for i in range(rows)], dtype=object),
            "rlreplay_trajectory": keys_arr,
            "acc": np.array([1.0] * rows),
        },
        meta_info={"reward_extra_keys": ["acc"]},
    )
    batch.reorder(torch.randperm(rows, generator=g))  # as balance_batch does
    return batch


def timed(fn: Any, batch_factory: Any, repeat: int, settle: Any = None) -> tuple[float, float]:
    """Median ms of ``fn`` on fresh batches, and median ms of ``settle`` after each (untimed by the
    first figure: the background work a real driver overlaps with its next minutes of work)."""
    times, settled = [], []
    for _ in range(repeat):
        batch = batch_factory()
        start = time.perf_counter()
        fn(batch, adv_estimator="grpo", num_repeat=4, norm_adv_by_std_in_grpo=True)
        times.append(time.perf_counter() - start)
        if settle is not None:
            start = time.perf_counter()
            settle()
            settled.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, statistics.median(settled or [0.0]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--big", action="store_true", help="2,048 rows x 8,192 tokens")
    args = parser.parse_args()
    if args.big:
        args.rows, args.length = 2048, 8192

    import torch
    import verl.trainer.ppo.ray_trainer as ray_trainer

    import rlreplay
    from rlreplay.recorders import verl_trainer

    torch.set_num_threads(1)
    original = ray_trainer.compute_advantage
    with tempfile.TemporaryDirectory() as tmp:
        rlreplay.init(Path(tmp) / "run", worker="driver")
        hooked = verl_trainer.wrap_compute_advantage(original)
        keys = [
            {"trajectory_id": f"{i:032x}", "step": 1, "sample_index": i // args.n, "rollout_n": i % args.n}
            for i in range(args.rows)
        ]

        def factory() -> Any:
            return make_batch(args.rows, args.length, args.n, keys)

        def settle() -> None:
            verl_trainer.drain(600)
            rlreplay.flush()

        timed(original, factory, 1)  # warm-up (kernels, imports)
        timed(hooked, factory, 1, settle)
        base, _ = timed(original, factory, args.repeat)
        with_hook, background = timed(hooked, factory, args.repeat, settle)
        rlreplay.close()
    print(f"batch: {args.rows} rows x {args.length} response tokens, GRPO n={args.n}, 1 torch thread")
    print(f"{'compute_advantage (verl)':<40} {base:9.1f} ms")
    print(f"{'compute_advantage + rlreplay signals':<40} {with_hook:9.1f} ms")
    print(f"{'added per driver step':<40} {with_hook - base:9.1f} ms  ({with_hook / base:.2f}x of this call)")
    print(f"{'signals thread + writer, per batch':<40} {background:9.1f} ms  (off the driver's path)")


if __name__ == "__main__":
    main()
