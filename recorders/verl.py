"""Record verl's rollout traces into rlreplay without editing verl, the user's script or config.

:func:`install` is called on ``verl.utils.rollout_trace`` the moment it is imported (see
``rlreplay.recorders.activate``). It replaces the module's ``rollout_trace_op`` and
``rollout_trace_attr`` so that every method decorated afterwards (``ToolAgentLoop.run``,
``LLMServerClient.generate``, the tool parsers' ``extract_tool_calls``, ``BaseTool.execute``,
user subclasses) is recorded as an rlreplay span, and every ``rollout_trace_attr`` block opens
an rlreplay trajectory. verl's own wrapper and context manager keep running inside, so its
weave/mlflow/trackio backends behave exactly as before.

Nothing heavy is imported at module top. ``install`` loads the recorder (pyarrow) only when this
process records (``$RLREPLAY_DIR`` or ``rlreplay.init``); decorating costs no import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from rlreplay.adapters.generic import GenericAdapter
from rlreplay.format import payload
from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_PARSER, KIND_TOOL
from rlreplay.text.conversation import ConversationFields

log = logging.getLogger("rlreplay")

TRACE_MODULE = "verl.utils.rollout_trace"

#: Span kind from the decorated method's name; anything else is "op".
KIND_BY_NAME = {
    "generate": KIND_LLM,
    "execute": KIND_TOOL,
    "extract_tool_calls": KIND_PARSER,
    "run": KIND_AGENT,
}

#: verl backends whose work happens inside verl's own wrapper; for any other value (None,
#: "rlreplay") verl's wrapper only binds arguments and calls through, so it is skipped.
_VERL_NOOP_BACKENDS = (None, "rlreplay")

_MARK = "__rlreplay_verl__"  # set on every function this module produces
_state_lock = threading.Lock()
_originals: dict[str, Any] = {}  # "op", "attr", "config": verl's own objects
_verl_codes: frozenset = frozenset()  # __code__ of verl's sync and async wrappers
_warned_late = False
_tokenizer_recorded = False
_MISSING: Any = object()


# ---- reducing large inputs on the calling thread ------------------------------------------------


class _Reduced:
    """Stands in for a large argument in the recorded call; the method itself gets the original."""

    __slots__ = ("summary",)

    def __init__(self, summary: dict[str, Any]) -> None:
        self.summary = summary


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _len(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def reduce_agent_data(agent_data: Any) -> dict[str, Any]:
    """What a user needs from verl's ``AgentData`` (the whole conversation state) in a tool call.

    The conversation itself is already in the agent and generate spans; this keeps the request
    id, the turn counts at call time, the tool kwargs and the sizes of the big fields.
    """
    get = agent_data.__dict__.get
    out: dict[str, Any] = payload.Marker(__type__="reduced", **{"class": _qualified(type(agent_data))})
    for key in ("request_id", "user_turns", "assistant_turns"):
        out[key] = get(key)
    out["num_messages"] = _len(get("messages"))
    out["num_prompt_ids"] = _len(get("prompt_ids"))
    out["num_response_ids"] = _len(get("response_mask"))
    tools_kwargs = get("tools_kwargs")
    out["tools_kwargs"] = dict(tools_kwargs) if isinstance(tools_kwargs, dict) else tools_kwargs
    for key in ("tool_rewards", "turn_scores"):
        value = get(key)
        out[key] = list(value) if isinstance(value, list) else value
    metrics = get("metrics")
    out["metrics"] = dict(metrics) if isinstance(metrics, dict) else None
    extra = get("extra_fields")
    out["extra_field_names"] = sorted(map(str, extra)) if isinstance(extra, dict) else None
    return out


_reducers: dict[str, Callable[[Any], dict[str, Any]]] = {"AgentData": reduce_agent_data}
_reducer_by_type: dict[type, Callable[[Any], dict[str, Any]] | None] = {}


def register_reducer(class_name: str, reducer: Callable[[Any], dict[str, Any]]) -> None:
    """Record arguments of class ``class_name`` (bare name) as ``reducer(value)`` instead of in full."""
    _reducers[class_name] = reducer
    _reducer_by_type.clear()


def _reducer_for(cls: type) -> Callable[[Any], dict[str, Any]] | None:
    reducer = _reducer_by_type.get(cls, _MISSING)
    if reducer is _MISSING:
        reducer = None
        for klass in cls.__mro__:
            reducer = _reducers.get(klass.__name__)
            if reducer is not None:
                break
        _reducer_by_type[cls] = reducer
    return reducer  # type: ignore[return-value]


def _reduce_value(value: Any) -> Any:
    reducer = _reducer_for(type(value))
    if reducer is None:
        return value
    try:
        summary = reducer(value)
    except Exception as exc:
        summary = payload.Marker(__type__="reduced", **{"class": _qualified(type(value)), "error": repr(exc)})
    return _Reduced(summary)


def _reduce_call(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The call with large arguments replaced by ``_Reduced`` markers, or None if nothing to reduce."""
    lookup = _reducer_by_type.get
    for value in (*args, *kwargs.values()) if args else kwargs.values():
        reducer = lookup(type(value), _MISSING)
        if reducer is None:
            continue
        if reducer is _MISSING and _reducer_for(type(value)) is None:
            continue
        return tuple(map(_reduce_value, args)), {k: _reduce_value(v) for k, v in kwargs.items()}
    return None


# The original arguments of a call whose recorded arguments were reduced; read once, by the
# innermost wrapper, in the same task (so concurrent calls never see each other's).
_ORIGINAL_CALL: ContextVar[tuple[tuple, dict] | None] = ContextVar("rlreplay_verl_call", default=None)


def _summaries(inputs: dict[str, Any]) -> dict[str, Any]:
    """reduce_inputs for the writer thread: markers become their summaries."""
    out = {}
    for key, value in inputs.items():
        if type(value) is _Reduced:
            value = value.summary
        elif type(value) is dict:
            value = {k: v.summary if type(v) is _Reduced else v for k, v in value.items()}
        elif type(value) in (list, tuple):
            value = [v.summary if type(v) is _Reduced else v for v in value]
        out[key] = value
    return out


def _tool_reward(result: Any) -> float | None:
    """``BaseTool.execute`` returns ``(ToolResponse, reward, metrics)``."""
    if isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], (int, float)):
        return None if isinstance(result[1], bool) else float(result[1])
    return None


# ---- the tokenizer, once per process ------------------------------------------------------------


def _tokenizer_name(owner: Any) -> str | None:
    tokenizer = getattr(owner, "tokenizer", None)
    name = getattr(tokenizer, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    return os.path.abspath(name) if os.path.isdir(name) else name


def _note_tokenizer(owner: Any) -> None:
    """Write the agent loop's tokenizer into the run manifest (if it names none), off the hot path."""
    global _tokenizer_recorded
    name = _tokenizer_name(owner)
    if name is None:
        return
    _tokenizer_recorded = True
    _note_in_manifest({"tokenizer": name})


_framework_noted = False
_manifest_lock = threading.Lock()
#: ``run.json``'s key naming the run's framework adapter (``rlreplay.adapters.registry.MANIFEST_KEY``).
FRAMEWORK_KEY = "framework"


def _note_framework() -> None:
    """This process records through verl's tracing: the run is verl's (``record --framework auto``)."""
    global _framework_noted
    _framework_noted = True
    _note_in_manifest({})


def _note_in_manifest(fields: dict[str, Any]) -> None:
    """Write ``fields`` the run manifest does not name yet, and that the run's framework is verl (if
    it names none: every write says so, so that none of this job's writes loses it), off the hot path."""
    from rlreplay.recorder.api import get_recorder

    recorder = get_recorder()
    if recorder is None:
        return
    run_dir = recorder.config.run_dir

    def write() -> None:
        from rlreplay.format import manifest

        with _manifest_lock:
            try:
                found = manifest.read_manifest(run_dir)
                missing = {
                    k: v for k, v in {FRAMEWORK_KEY: ADAPTER.name, **fields}.items() if not found.get(k)
                }
                if missing:
                    manifest.update_manifest(run_dir, **missing)
            except Exception as exc:
                log.warning(
                    "rlreplay: could not write %s in the run manifest: %s",
                    ", ".join(fields) or "the framework",
                    exc,
                )

    threading.Thread(target=write, name="rlreplay-manifest").start()


# ---- wrapping one decorated method ------------------------------------------------------------


def infer_kind(func: Callable[..., Any]) -> str:
    """The span kind of a decorated method: the verl adapter's answer for its name."""
    return ADAPTER.span_kind(getattr(func, "__name__", ""))


def _wrap(verl_wrapper: Callable[..., Any], func: Callable[..., Any]) -> Callable[..., Any]:
    """rlreplay's wrapper around verl's wrapper of ``func`` (recorded under ``func.__qualname__``).

    verl's wrapper is called only when verl's backend does its own work (weave, mlflow, trackio);
    the rlreplay recorder is built on the first call, so decorating costs no import.
    """
    kind = infer_kind(func)
    name = getattr(func, "__qualname__", getattr(func, "__name__", "op"))
    wants_tokenizer = kind in (KIND_AGENT, KIND_LLM)
    get_config = _originals["config"].get_instance
    is_async = inspect.iscoroutinefunction(func)
    traced_box: list[Any] = []

    if is_async:

        @functools.wraps(func)
        async def call_through(*args: Any, **kwargs: Any) -> Any:
            original = _ORIGINAL_CALL.get()
            if original is not None:
                _ORIGINAL_CALL.set(None)
                args, kwargs = original
            if get_config().backend in _VERL_NOOP_BACKENDS:
                return await func(*args, **kwargs)
            return await verl_wrapper(*args, **kwargs)

    else:

        @functools.wraps(func)
        def call_through(*args: Any, **kwargs: Any) -> Any:
            original = _ORIGINAL_CALL.get()
            if original is not None:
                _ORIGINAL_CALL.set(None)
                args, kwargs = original
            if get_config().backend in _VERL_NOOP_BACKENDS:
                return func(*args, **kwargs)
            return verl_wrapper(*args, **kwargs)

    def build() -> Callable[..., Any]:
        from rlreplay.recorder.api import trace_op

        traced = trace_op(
            call_through,
            name=name,
            kind=kind,
            reduce_inputs=_summaries,
            reward=_tool_reward if kind == KIND_TOOL else None,
        )
        traced_box.append(traced)
        return traced

    if is_async:

        @functools.wraps(func)
        async def rlreplay_verl_op(*args: Any, **kwargs: Any) -> Any:
            traced = traced_box[0] if traced_box else build()
            if wants_tokenizer and not _tokenizer_recorded and args:
                _note_tokenizer(args[0])
            reduced = _reduce_call(args, kwargs)
            if reduced is None:
                return await traced(*args, **kwargs)
            token = _ORIGINAL_CALL.set((args, kwargs))
            try:
                return await traced(*reduced[0], **reduced[1])
            finally:
                _ORIGINAL_CALL.reset(token)

    else:

        @functools.wraps(func)
        def rlreplay_verl_op(*args: Any, **kwargs: Any) -> Any:
            traced = traced_box[0] if traced_box else build()
            if wants_tokenizer and not _tokenizer_recorded and args:
                _note_tokenizer(args[0])
            reduced = _reduce_call(args, kwargs)
            if reduced is None:
                return traced(*args, **kwargs)
            token = _ORIGINAL_CALL.set((args, kwargs))
            try:
                return traced(*reduced[0], **reduced[1])
            finally:
                _ORIGINAL_CALL.reset(token)

    setattr(rlreplay_verl_op, _MARK, True)
    rlreplay_verl_op.__rlreplay_verl_wrapper__ = verl_wrapper  # type: ignore[attr-defined]
    return rlreplay_verl_op


def _make_trace_op(original_op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original_op)
    def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
        """verl's ``rollout_trace_op``, also recording each call into rlreplay."""
        return _wrap(original_op(func), func)

    setattr(rollout_trace_op, _MARK, True)
    return rollout_trace_op


#: The trajectory being recorded in this task: {"trajectory_id", "step", "sample_index",
#: "rollout_n", "validate"}, carried into verl's batch so that the trainer's signals join it.
_TRAJECTORY_KEY: ContextVar[dict[str, Any] | None] = ContextVar("rlreplay_verl_trajectory", default=None)

#: The ``AgentLoopOutput.extra_fields`` key (and so the ``DataProto.non_tensor_batch`` key) holding it.
EXTRA_FIELD = "rlreplay_trajectory"
AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"


def current_trajectory_key() -> dict[str, Any] | None:
    return _TRAJECTORY_KEY.get()


def install_agent_loop(module: ModuleType) -> None:
    """Make ``AgentLoopWorker._agent_loop_postprocess`` put the trajectory key into ``extra_fields``.

    verl copies ``extra_fields`` into the batch's ``non_tensor_batch``, which follows every row
    through ``balance_batch`` and the trainer, so driver-side signals join the exact trajectory.
    """
    worker = getattr(module, "AgentLoopWorker", None)
    _wait_for_batch_on_disk(worker)
    original = getattr(worker, "_agent_loop_postprocess", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    async def _agent_loop_postprocess(self: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        key = _TRAJECTORY_KEY.get()
        if key is not None:
            extra = getattr(output, "extra_fields", None)
            if isinstance(extra, dict):
                extra[EXTRA_FIELD] = key
        return await original(self, output, *args, **kwargs)

    setattr(_agent_loop_postprocess, _MARK, True)
    worker._agent_loop_postprocess = _agent_loop_postprocess


#: How long a batch may wait for its trajectories to reach disk before it is returned anyway.
BATCH_ON_DISK_TIMEOUT_S = 10.0


def _wait_for_batch_on_disk(worker: Any) -> None:
    """``AgentLoopWorker.generate_sequences`` returns its batch only once the batch's trajectories
    are written: the trainer may stop this worker (Ray kills actors without atexit) as soon as it
    has the batch. The event loop is not blocked: the wait runs on a helper thread, while the
    writer thread writes what the last agent loop's ``request_flush`` asked for."""
    original = getattr(worker, "generate_sequences", None)
    if original is None or getattr(original, _MARK, False) or not inspect.iscoroutinefunction(original):
        return

    @functools.wraps(original)
    async def generate_sequences(self: Any, *args: Any, **kwargs: Any) -> Any:
        _unshare_rows(args[0] if args else kwargs.get("batch"))
        output = await original(self, *args, **kwargs)
        try:
            import asyncio

            from rlreplay.recorder.api import get_recorder

            recorder = get_recorder()
            if recorder is not None and not await asyncio.to_thread(
                recorder.wait_written, BATCH_ON_DISK_TIMEOUT_S
            ):
                log.warning("rlreplay: a batch was returned before its trajectories reached disk")
        except Exception as exc:
            log.warning("rlreplay: waiting for a batch to reach disk failed: %s", exc)
        return output

    setattr(generate_sequences, _MARK, True)
    worker.generate_sequences = generate_sequences


def _unshare_rows(batch: Any) -> None:
    """Under a replay, give each row of ``batch`` its own copy of a dict it shares with other rows.

    ``DataProto.repeat`` puts one ``extra_info`` dict in every rollout of a prompt, and verl's reward
    managers add to it in place (``extra_info.update(tool_extra_fields)``, ``["num_turns"]``). A
    served agent loop ends at once, so its reward would change the inputs of its prompt's rollouts
    that have not started yet, and they would diverge from the recording.
    """
    from rlreplay.recorder.api import get_replay

    if get_replay() is None:
        return
    try:
        for column in getattr(batch, "non_tensor_batch", {}).values():
            if getattr(getattr(column, "dtype", None), "kind", None) != "O":
                continue
            seen: set[int] = set()
            for i, value in enumerate(column):
                if isinstance(value, dict):
                    if id(value) in seen:
                        column[i] = dict(value)
                    seen.add(id(value))
    except Exception as exc:
        log.warning("rlreplay: could not copy a batch's shared rows: %s", exc)


_in_flight = [0]  # agent loops open in this process
_in_flight_lock = threading.Lock()


def _flush_batch() -> None:
    """The last open agent loop of a batch ended: have the writer make the batch durable now.

    Ray stops actors without running atexit handlers, so the batch must be on disk before the
    trainer may kill this worker. The calling thread (the rollout's event loop) only signals: the
    writer thread writes the finished trajectories at once, while verl post-processes the batch.
    """
    from rlreplay.recorder.api import get_recorder

    try:
        recorder = get_recorder()
        if recorder is not None:
            recorder.request_flush()
    except Exception as exc:
        log.warning("rlreplay: flush at the end of a batch failed: %s", exc)


def _make_trace_attr(original_attr: Callable[..., Any], config_cls: Any) -> Callable[..., Any]:
    @contextlib.contextmanager
    def rollout_trace_attr(
        sample_index: Any = None,
        step: Any = None,
        rollout_n: Any = None,
        name: str = "rollout_trace",
        validate: bool = False,
        trace: bool = True,
    ) -> Iterator[None]:
        """verl's ``rollout_trace_attr``, also opening an rlreplay trajectory.

        ``trace=False`` (verl's per-worker sampling) is honoured only when the user asked for
        sampling (``max_samples_per_step_per_worker`` set); otherwise everything is recorded.
        """
        config = config_cls.get_instance()
        record = trace or config.max_samples_per_step_per_worker is None
        from rlreplay.recorder.api import get_recorder, trajectory

        traj = trajectory(
            step=step,
            sample_index=sample_index,
            rollout_n=rollout_n,
            validate=validate,
            experiment=config.experiment_name,
            name=name,
            trace=record,
            write_at_end=False,  # the batch is flushed when its last agent loop ends (_flush_batch)
        )
        with _in_flight_lock:
            _in_flight[0] += 1
        try:
            with (
                original_attr(
                    sample_index=sample_index,
                    step=step,
                    rollout_n=rollout_n,
                    name=name,
                    validate=validate,
                    trace=trace,
                ),
                traj,
            ):
                key = None
                if record and get_recorder() is not None:
                    if not _framework_noted:
                        _note_framework()
                    key = {
                        "trajectory_id": traj.id,
                        "root_span_id": traj.root_span_id,
                        "step": step,
                        "sample_index": sample_index,
                        "rollout_n": rollout_n,
                        "validate": bool(validate),
                    }
                token = _TRAJECTORY_KEY.set(key)
                try:
                    yield
                finally:
                    _TRAJECTORY_KEY.reset(token)
        finally:
            with _in_flight_lock:
                _in_flight[0] -= 1
                last = _in_flight[0] == 0
            if last:
                _flush_batch()

    rollout_trace_attr.__wrapped__ = original_attr  # type: ignore[attr-defined]
    setattr(rollout_trace_attr, _MARK, True)
    return rollout_trace_attr


# ---- installation ---------------------------------------------------------------------------------


def _wrapper_codes(original_op: Callable[..., Any]) -> frozenset:
    def probe(self: Any) -> None:
        return None

    async def aprobe(self: Any) -> None:
        return None

    codes = set()
    for fn in (probe, aprobe):
        with contextlib.suppress(Exception):
            codes.add(original_op(fn).__code__)
    return frozenset(codes)


def install(module: ModuleType) -> None:
    """Patch ``verl.utils.rollout_trace`` (idempotent); re-wrap anything decorated before this."""
    global _verl_codes
    with _state_lock:
        if getattr(module, "__rlreplay_installed__", False):
            return
        original_op = module.rollout_trace_op
        original_attr = module.rollout_trace_attr
        if getattr(original_op, _MARK, False) or getattr(original_attr, _MARK, False):
            return
        _originals.update(op=original_op, attr=original_attr, config=module.RolloutTraceConfig)
        _verl_codes = _wrapper_codes(original_op)
        module.rollout_trace_op = _make_trace_op(original_op)
        module.rollout_trace_attr = _make_trace_attr(original_attr, module.RolloutTraceConfig)
        module.__rlreplay_installed__ = True
    patch_already_imported()
    _prepare_recorder()


def _prepare_recorder() -> None:
    """When this process records, pay the writer's one-time imports now, while verl is imported.

    pyarrow imports pandas on its first conversion; done lazily on the first span, that import
    would land inside the user's code, e.g. inside a test that patches ``sys.modules`` (verl's
    own tests do), which then drops pandas from ``sys.modules`` and breaks later imports.
    """
    try:
        from rlreplay.recorder.api import get_recorder

        if get_recorder() is None:
            return
        import pyarrow as pa

        pa.array([0], type=pa.int64())
    except Exception as exc:
        log.warning("rlreplay: could not prepare the recorder: %s", exc)


def _patched(name: str) -> Any:
    module = sys.modules.get(TRACE_MODULE)
    return getattr(module, name, None) if module is not None else None


def _rewrap_existing(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """rlreplay's wrapper for a function verl's wrapper produced before :func:`install` ran."""
    func = getattr(fn, "__wrapped__", None)
    if func is None:
        return None
    return _wrap(fn, func)


def _patch_namespace(owner: Any, items: list[tuple[str, Any]], where: str, found: list[str]) -> None:
    for attr, value in items:
        target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        code = getattr(target, "__code__", None)
        if code is None or code not in _verl_codes or getattr(target, _MARK, False):
            continue
        new = _rewrap_existing(target)
        if new is None:
            continue
        if isinstance(value, staticmethod):
            new = staticmethod(new)
        elif isinstance(value, classmethod):
            new = classmethod(new)
        try:
            setattr(owner, attr, new)
            found.append(f"{where}.{attr}")
        except (AttributeError, TypeError):
            continue


def patch_already_imported() -> list[str]:
    """Re-wrap verl-traced functions defined before the hook ran, and rebind imported names.

    Scans loaded ``verl.*`` modules and every module that imported ``rollout_trace_op`` or
    ``rollout_trace_attr`` by name; methods made by verl's wrapper (recognised by its code object)
    are wrapped again through ``__wrapped__``. Warns once when anything had to be re-wrapped.
    Returns the names that were re-wrapped.
    """
    global _warned_late
    if not _originals:
        return []
    original_op, original_attr = _originals["op"], _originals["attr"]
    new_op, new_attr = _patched("rollout_trace_op"), _patched("rollout_trace_attr")
    found: list[str] = []
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict) or mod_name == TRACE_MODULE:
            continue
        holds_op = namespace.get("rollout_trace_op") is original_op
        holds_attr = namespace.get("rollout_trace_attr") is original_attr
        if not (mod_name.startswith("verl.") or holds_op or holds_attr):
            continue
        for key, value in list(namespace.items()):
            if value is original_op and new_op is not None:
                namespace[key] = new_op
            elif value is original_attr and new_attr is not None:
                namespace[key] = new_attr
        functions = [(k, v) for k, v in namespace.items() if inspect.isfunction(v)]
        _patch_namespace(mod, functions, mod_name, found)
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == mod_name:
                _patch_namespace(value, list(vars(value).items()), f"{mod_name}.{value.__qualname__}", found)
    if found and not _warned_late:
        _warned_late = True
        shown = ", ".join(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in found[:4])
        log.warning(
            "rlreplay: %d verl-traced method(s) were defined before rlreplay's hook (%s%s); "
            "re-wrapped them through __wrapped__. Start the job with `rlreplay record -- ...` "
            "to hook verl before it is imported.",
            len(found),
            shown,
            ", ..." if len(found) > 4 else "",
        )
    return found


# ---- the verl framework adapter -------------------------------------------------------------------

_HYDRA_EXPERIMENT = re.compile(r"^\+*trainer\.experiment_name=(.+)$")
_HYDRA_MODEL = re.compile(r"^\+*actor_rollout_ref\.model\.(tokenizer_path|path)=(.+)$")


def _set_fields(value: Any) -> Any:
    """A dumped ``OpenAIFunctionToolSchema`` without its None values and its default ``strict: false``
    (what ``exclude_none`` and ``exclude_unset`` leave out)."""
    if isinstance(value, list):
        return [_set_fields(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _set_fields(v) for k, v in value.items() if v is not None}
    if out.get("strict") is False and "name" in out:
        del out["strict"]
    return out


_VOLATILE = frozenset({"metrics", EXTRA_FIELD})
#: What verl's post-processing adds to an ``AgentLoopOutput`` after ``run`` returned it.
_POSTPROCESS_EXTRA_FIELDS = ("raw_prompt", EXTRA_FIELD, "reward_extra_info")


def _as_run_returned(output: dict[str, Any]) -> dict[str, Any]:
    """An agent output recorded before outputs were copied at return (rlreplay's own key in its
    ``extra_fields`` marks it) holds verl's post-processing, the reward among it: served as it is,
    verl would skip the replay's reward. It is served without what the post-processing added."""
    extra = output.get("extra_fields")
    if not isinstance(extra, dict) or EXTRA_FIELD not in extra:
        return output
    kept = {k: v for k, v in extra.items() if k not in _POSTPROCESS_EXTRA_FIELDS}
    return {**output, "extra_fields": kept, "reward_score": None}


def _verl_class(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _TOKEN_OUTPUT(value: Any) -> Any:
    return _verl_class("verl.workers.rollout.replica", "TokenOutput").model_validate(value)


def _AGENT_OUTPUT(value: Any) -> Any:
    cls = _verl_class("verl.experimental.agent_loop.agent_loop", "AgentLoopOutput")
    return cls.model_validate(_as_run_returned(value))


def _TOOL_RESPONSE(value: Any) -> Any:
    # a field recorded as None was not set (verl refuses ``image=None``)
    response = {k: v for k, v in value.items() if v is not None}
    return _verl_class("verl.tools.schemas", "ToolResponse").model_validate(response)


#: verl's types a replay rebuilds, by the qualified class a type record names.
_VERL_BUILDERS: dict[str, Callable[[Any], Any]] = {
    "verl.workers.rollout.replica.TokenOutput": _TOKEN_OUTPUT,
    "verl.experimental.agent_loop.agent_loop.AgentLoopOutput": _AGENT_OUTPUT,
    "verl.tools.schemas.ToolResponse": _TOOL_RESPONSE,
}


class VerlAdapter(GenericAdapter):
    """verl 0.9: ``AgentLoopOutput`` fields, Hermes tool calls, Hydra overrides, the rollout-trace hook.

    Turns follow the agent span's ``response_mask``; the prompt's chat messages are the
    ``raw_prompt`` verl passes to ``AgentLoopBase.run``; tool responses are ``ToolResponse.text``.
    """

    name = "verl"
    kind_by_name = KIND_BY_NAME
    #: ``TokenOutput.stop_reason`` is "completed", "aborted" or vLLM's finish reason ("length" at the
    #: limit); the request's ``sampling_params`` may carry ``max_tokens`` (or ``max_new_tokens``),
    #: else the server's ``response_length`` applies
    fields = ConversationFields(
        stop_reason=("stop_reason",), max_tokens=("max_tokens", "max_new_tokens"), length_stops=("length",)
    )
    prompt_message_fields = ("raw_prompt",)

    def install(self) -> None:
        """Hook verl's tracing module (now if imported, else when imported) and its trainer."""
        from rlreplay.recorders import activate

        activate.activate()

    def tool_schemas(self, traj: Any) -> list[dict[str, Any]] | None:
        """The schemas as ``ToolAgentLoop`` renders the prompt with them:
        ``model_dump(exclude_unset=True, exclude_none=True)``. Parser calls are given the schema objects
        whole, so their recorded form has the unset defaults too (``strict: false``, ``enum: null``)."""
        found = super().tool_schemas(traj)
        return None if found is None else [_set_fields(t) for t in found]

    def output_builders(self) -> dict[str, Any]:
        """verl's own types: ``TokenOutput`` (model calls), ``AgentLoopOutput`` (agent loops),
        ``ToolResponse`` (in a tool's ``(ToolResponse, reward, metrics)``)."""
        return _VERL_BUILDERS

    def rebuild_output(self, name: str, kind: str, output: Any, output_type: dict[str, str] | None) -> Any:
        """What the op returned, verl's types rebuilt where the output's type record names them. An
        output recorded before outputs had a type record is rebuilt by its span's kind, as it was
        then: a model call's dict as ``TokenOutput``, an agent loop's as ``AgentLoopOutput``, a tool's
        ``[response, reward, metrics]`` as ``(ToolResponse, reward, metrics)``."""
        if output_type is not None:
            return super().rebuild_output(name, kind, output, output_type)
        output = payload.from_json(output)
        if kind == KIND_LLM and isinstance(output, dict):
            return _TOKEN_OUTPUT(output)
        if kind == KIND_AGENT and isinstance(output, dict):
            return _AGENT_OUTPUT(output)
        if (
            kind == KIND_TOOL
            and isinstance(output, list)
            and len(output) == 3
            and isinstance(output[0], dict)
        ):
            return _TOOL_RESPONSE(output[0]), output[1], output[2]
        return output

    def volatile_keys(self) -> frozenset[str]:
        """Per-call ids, and what differs between two runs of the same rollout: the timing
        ``metrics`` (of ``AgentLoopOutput``, and of ``AgentData`` in a tool call's inputs) and
        rlreplay's own trajectory key in ``extra_fields``."""
        return super().volatile_keys() | _VOLATILE

    def tokenizer_from_argv(self, argv: list[str]) -> str | None:
        """``actor_rollout_ref.model.tokenizer_path=`` wins over ``actor_rollout_ref.model.path=``."""
        found: dict[str, str] = {}
        for arg in argv:
            if m := _HYDRA_MODEL.match(arg):
                found[m.group(1)] = m.group(2).strip("'\"")
        return found.get("tokenizer_path") or found.get("path")

    def experiment_from_argv(self, argv: list[str]) -> str | None:
        experiment = None
        for arg in argv:
            if m := _HYDRA_EXPERIMENT.match(arg):
                experiment = m.group(1).strip("'\"")
        return experiment


ADAPTER = VerlAdapter()
