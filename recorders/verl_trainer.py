"""Trainer-side signals for every verl trajectory: reward, reward extras, advantage, log-prob mismatch.

:func:`install` runs when ``verl.trainer.ppo.ray_trainer`` is imported in the driver (see
``rlreplay.recorders.activate``). It wraps two functions of that module, without editing verl:

- ``compute_advantage`` (called by ``RayPPOTrainer.fit`` on the driver, after rewards and
  ``old_log_probs``): per row, the reward verl trains on (``token_level_scores`` summed), the
  reward function's extra fields (``meta_info["reward_extra_keys"]``), the advantage (the
  advantage of the row's first model token: GRPO's per-trajectory scalar), and, when both
  ``old_log_probs`` and ``rollout_log_probs`` exist, mean and max ``|old - rollout|`` over model
  tokens (``response_mask``) and the sequence importance ratio ``exp(sum(old - rollout))``.
- ``extract_reward`` on validation batches (``RayPPOTrainer._validate``): rewards and extras.

Each row is joined to its agent-loop trajectory by the key the agent loop put into
``non_tensor_batch["rlreplay_trajectory"]`` (see ``rlreplay.recorders.verl.install_agent_loop``),
which travels with the row through ``balance_batch`` and any reordering. Per-token trainer
log-probs are kept only when ``RLREPLAY_TOKEN_SIGNALS=1`` (``rlreplay record --token-signals``).
The driver's thread only takes references to the batch's tensors; the figures are computed and
queued to the recorder on a background thread (verl does not modify these tensors in place
after ``compute_advantage``). Nothing here raises into the trainer: a failure is logged once
and counted as lost.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rlreplay import settings
from rlreplay.recorders.verl import EXTRA_FIELD

log = logging.getLogger("rlreplay")

TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
_MARK = "__rlreplay_verl_trainer__"
_warned: set[str] = set()
unmatched_rows = [0]  # rows without a recorded trajectory (e.g. verl's per-worker trace sampling)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("rlreplay: %s", message)


def token_signals_wanted() -> bool:
    return settings.TOKEN_SIGNALS.get_or_default()


@functools.lru_cache(maxsize=1)
def _record_signals() -> tuple[Any, str | None]:
    """The recorder's ``record_signals`` and the name of its argument for the trajectory's root
    span id, if it has one."""
    import inspect

    from rlreplay.recorder.signals import record_signals

    try:
        params = inspect.signature(record_signals).parameters
    except (TypeError, ValueError):
        params = {}
    return record_signals, next((p for p in ("root_span_id", "parent_id") if p in params), None)


def _send(
    keys: list[Any], columns: dict[str, list[Any] | None], extras: list[dict], outputs: list | None
) -> int:
    """One ``signals`` row per recorded trajectory (the first occurrence of each); returns rows sent."""
    record_signals, root_arg = _record_signals()
    seen: set[str] = set()
    sent = 0
    for i, key in enumerate(keys):
        if not isinstance(key, dict) or not key.get("trajectory_id"):
            unmatched_rows[0] += 1
            continue
        if key["trajectory_id"] in seen:  # a row resampled by the estimator (e.g. PF-PPO)
            continue
        seen.add(key["trajectory_id"])
        values = {name: (col[i] if col is not None else None) for name, col in columns.items()}
        attributes = {"reward_extra": extras[i]} if extras[i] else {}
        for name in list(values):
            if name.startswith("_"):
                value = values.pop(name)
                if value is not None:
                    attributes[name[1:]] = value
        if root_arg is not None:
            values[root_arg] = key.get("root_span_id")
        record_signals(
            key["trajectory_id"],
            step=key.get("step"),
            sample_index=key.get("sample_index"),
            rollout_n=key.get("rollout_n"),
            validate=bool(key.get("validate")),
            attributes=attributes or None,
            output=outputs[i] if outputs is not None else None,
            **values,
        )
        sent += 1
    return sent


def _floats(tensor: Any) -> list[float | None]:
    return [None if v != v else v for v in tensor.double().tolist()]  # NaN: not computed


_TENSORS = (
    "response_mask",
    "attention_mask",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "old_log_probs",
    "rollout_log_probs",
)


def _training_snapshot(data: Any, token_signals: bool | None = None) -> dict[str, Any] | None:
    """References to what the signals need (no copies): cheap, on the driver's thread."""
    keys = getattr(data, "non_tensor_batch", {}).get(EXTRA_FIELD)
    if keys is None:
        unmatched_rows[0] += len(data)
        return None
    present = set(data.batch.keys())
    extra_keys = list(data.meta_info.get("reward_extra_keys", []) or [])
    return {
        "keys": keys,
        "tensors": {k: data.batch[k] for k in _TENSORS if k in present},
        "uid": data.non_tensor_batch.get("uid"),
        "extras": {k: data.non_tensor_batch[k] for k in extra_keys if k in data.non_tensor_batch},
        "tokens": token_signals_wanted() if token_signals is None else token_signals,
    }


def _training_rows(snap: dict[str, Any]) -> int:
    """Reward, extras, advantage and log-prob mismatch per row, then one signals row each."""
    import torch

    t = snap["tensors"]
    keys = list(snap["keys"])
    n = len(keys)
    mask = t["response_mask"].bool()
    has_tokens = mask.any(-1)
    f64 = torch.float64
    scores, rewards = t.get("token_level_scores"), t.get("token_level_rewards")
    source = scores if scores is not None else rewards
    columns: dict[str, list[Any] | None] = {
        "reward": _floats(source.sum(-1, dtype=f64)) if source is not None else None
    }
    if (
        scores is not None
        and rewards is not None
        and scores.data_ptr() != rewards.data_ptr()
        and not torch.equal(scores, rewards)
    ):
        columns["_reward_with_kl"] = _floats(rewards.sum(-1, dtype=f64))
    if "advantages" in t:
        first = mask.to(torch.int8).argmax(-1, keepdim=True)
        adv = t["advantages"].gather(1, first).squeeze(1).to(f64)
        columns["advantage"] = _floats(torch.where(has_tokens, adv, torch.nan))
    if "old_log_probs" in t and "rollout_log_probs" in t:
        delta = torch.where(mask, t["old_log_probs"] - t["rollout_log_probs"], 0.0)
        count = mask.sum(-1).to(f64)
        absolute = delta.abs()
        nan = torch.full_like(count, torch.nan)
        mean = absolute.sum(-1, dtype=f64) / count.clamp(min=1)
        columns["logprob_diff_mean"] = _floats(torch.where(has_tokens, mean, nan))
        columns["logprob_diff_max"] = _floats(torch.where(has_tokens, absolute.max(-1).values.to(f64), nan))
        ratio = torch.exp(delta.sum(-1, dtype=f64))
        columns["importance_ratio"] = _floats(torch.where(has_tokens, ratio, nan))
    if snap["uid"] is not None:
        columns["_uid"] = [str(u) for u in snap["uid"]]
    extras: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, values in snap["extras"].items():
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) == n:
            for row, value in zip(extras, values):
                row[key] = value
    outputs = None
    if snap["tokens"] and "old_log_probs" in t:
        length = t["attention_mask"][:, -mask.shape[1] :].sum(-1).tolist()
        old = t["old_log_probs"].float().tolist()
        outputs = [{"old_log_probs": row[:k]} for row, k in zip(old, length)]
    return _send(keys, columns, extras, outputs)


def training_signals(data: Any, token_signals: bool | None = None) -> int:
    """Record reward, extras, advantage and log-prob mismatch for every row of a trained batch, now."""
    snap = _training_snapshot(data, token_signals)
    return 0 if snap is None else _training_rows(snap)


def _validation_snapshot(data: Any, reward_tensor: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    keys = getattr(data, "non_tensor_batch", {}).get(EXTRA_FIELD)
    if keys is None:
        unmatched_rows[0] += len(data)
        return None
    return {"keys": keys, "reward": reward_tensor, "extras": dict(extra or {})}


def _validation_rows(snap: dict[str, Any]) -> int:
    import torch

    keys = list(snap["keys"])
    n = len(keys)
    columns: dict[str, list[Any] | None] = {"reward": _floats(snap["reward"].sum(-1, dtype=torch.float64))}
    extras: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, values in snap["extras"].items():
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) == n:
            for row, value in zip(extras, values):
                row[key] = value
    return _send(keys, columns, extras, None)


def validation_signals(data: Any, reward_tensor: Any, reward_extra_info: dict[str, Any]) -> int:
    """Record reward and extras for every row of a validation batch (verl computes no advantage there)."""
    snap = _validation_snapshot(data, reward_tensor, reward_extra_info)
    return 0 if snap is None else _validation_rows(snap)


# ---- off the driver's path ----------------------------------------------------------------------

_queue: queue.SimpleQueue = queue.SimpleQueue()
_pending = [0]
_idle = threading.Condition()
_thread: list[threading.Thread] = []


def _work() -> None:
    while True:
        what, fn, snap = _queue.get()
        _guarded(what, fn, snap)
        with _idle:
            _pending[0] -= 1
            _idle.notify_all()


def _submit(what: str, fn: Any, snap: dict[str, Any] | None) -> None:
    """Compute and record on rlreplay's signals thread; the batch's tensors are read, never copied."""
    if snap is None:
        return
    with _idle:
        _pending[0] += 1
        if not _thread or not _thread[0].is_alive():
            _thread[:] = [threading.Thread(target=_work, name="rlreplay-signals", daemon=True)]
            _thread[0].start()
            atexit.register(drain)  # after the recorder's own exit hook was registered: runs first
    _queue.put((what, fn, snap))


def drain(timeout: float = 30.0) -> bool:
    """Wait until every batch handed to the signals thread is recorded (queued to the recorder)."""
    deadline = time.monotonic() + timeout
    with _idle:
        while _pending[0]:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _idle.wait(left)
    return True


def _guarded(what: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        _warn_once(what, f"could not record {what} signals: {type(exc).__name__}: {exc}")
        try:
            from rlreplay.recorder.api import get_recorder, untraced_failure

            rec = get_recorder()
            if rec is not None:
                untraced_failure(rec, exc)
        except Exception:
            pass


def _raise(exc: Exception) -> None:
    raise exc


def _wrap_after(original: Any, what: str, rows: Callable, snapshot: Callable[[Any, Any], Any]) -> Any:
    """``original`` unchanged for its caller; after it returns, its figures go to the background."""

    first_name = next(iter(inspect.signature(original).parameters), "")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            taken = snapshot(args[0] if args else kwargs[first_name], result)
            if taken is not None:
                _submit(what, rows, taken)
        except Exception as exc:
            _guarded(what, _raise, exc)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _validation_if_validating(batch: Any, result: Any) -> Any:
    return _validation_snapshot(batch, *result) if getattr(batch, "meta_info", {}).get("validate") else None


def wrap_compute_advantage(original: Any) -> Any:
    return _wrap_after(original, "training", _training_rows, lambda _data, result: _training_snapshot(result))


def wrap_extract_reward(original: Any) -> Any:
    return _wrap_after(original, "validation", _validation_rows, _validation_if_validating)


def install(module: ModuleType) -> None:
    """Wrap ``compute_advantage`` and ``extract_reward`` in the trainer module (idempotent) and
    in verl modules that imported them by name before this ran."""
    from rlreplay.recorder.api import get_recorder

    if get_recorder() is None:  # this process does not record
        return
    replaced = {}
    for name, wrap in (
        ("compute_advantage", wrap_compute_advantage),
        ("extract_reward", wrap_extract_reward),
    ):
        original = getattr(module, name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        replaced[id(original)] = wrap(original)
        setattr(module, name, replaced[id(original)])
    if not replaced:
        return
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if mod is module or not mod_name.startswith("verl.") or not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if id(value) in replaced and callable(value):
                namespace[key] = replaced[id(value)]
