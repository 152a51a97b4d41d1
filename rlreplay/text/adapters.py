"""Framework adapters: everything rlreplay knows about one RL framework's recorded data.

An adapter says how a framework is hooked into a recording process, how its traced methods map
to span kinds, which recorded fields hold token ids, how a trajectory becomes a conversation of
turns and OpenAI chat messages, and how to find the tokenizer and experiment on a command line.

Adapters are found through the entry-point group ``rlreplay.recorders`` (rlreplay's own
``generic`` and ``verl`` are registered there too), so a new framework is one package declaring
``[project.entry-points."rlreplay.recorders"] myfw = "mypkg.adapter:MyAdapter"``. A run names its
framework in ``run.json`` (``"framework"``); runs without one are read with ``generic``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlreplay import plugins
from rlreplay.errors import RunError
from rlreplay.text.conversation import first_field, function_calls, llm_output_ids, llm_prompt_ids, segment
from rlreplay.text.messages import build_messages

# rlreplay.format.schema's kinds, spelled out: this module is imported by recording processes, which
# must not pay for pyarrow before they record.
KIND_AGENT, KIND_LLM, KIND_OP, KIND_PARSER, KIND_TOOL = "agent", "llm", "op", "parser", "tool"

if TYPE_CHECKING:
    from rlreplay.model import Span, Trajectory
    from rlreplay.text.conversation import BatchDecoder, Turn

MANIFEST_KEY = "framework"
DEFAULT = "generic"


@runtime_checkable
class FrameworkAdapter(Protocol):
    name: str

    def install(self) -> None: ...

    def span_kind(self, qualname: str) -> str: ...

    def token_fields(self, kind: str) -> dict[str, tuple[str, ...]]: ...

    def turns(self, traj: Trajectory) -> list[Turn]: ...

    def messages(self, traj: Trajectory, decoder: BatchDecoder | None) -> list[dict[str, Any]]: ...

    def tokenizer_from_argv(self, argv: list[str]) -> str | None: ...

    def experiment_from_argv(self, argv: list[str]) -> str | None: ...


@dataclass(frozen=True)
class ConversationFields:
    """Where a conversation's token ids live in recorded spans (names tried in order)."""

    prompt: tuple[str, ...] = ("prompt_ids",)  # agent output: the prompt
    response: tuple[str, ...] = ("response_ids",)  # agent output: the whole response
    mask: tuple[str, ...] = ("response_mask",)  # agent output: 1 = model token, 0 = tool token
    llm_prompt: tuple[str, ...] = ("prompt_ids",)  # llm inputs (or inputs["kwargs"])
    llm_output: tuple[str, ...] = ("token_ids", "output_ids")  # llm output
    log_probs: tuple[str, ...] = ("log_probs", "response_logprobs")
    reward: tuple[str, ...] = ("reward_score", "reward")  # agent/trajectory output
    stop_reason: tuple[str, ...] = ("stop_reason", "finish_reason")  # llm output: why it stopped
    max_tokens: tuple[str, ...] = ("max_tokens", "max_new_tokens")  # llm inputs (or sampling params)
    #: stop reasons meaning the call hit its length limit
    length_stops: tuple[str, ...] = ("length", "max_tokens")


class GenericAdapter:
    """Any agent loop recorded with ``rlreplay.trace_op``: kinds from method names, turns from ids.

    The conversation comes from the agent span's ``prompt_ids``/``response_ids``/``response_mask``
    when it has them, else from the ``llm`` spans alone (see ``rlreplay.text.conversation``).
    """

    name = "generic"
    fields = ConversationFields()
    #: span kind from the traced method's name (the last part of its qualified name)
    kind_by_name: dict[str, str] = {  # noqa: RUF012
        "generate": KIND_LLM,
        "execute": KIND_TOOL,
        "extract_tool_calls": KIND_PARSER,
        "run": KIND_AGENT,
    }
    #: agent-span input fields that may hold the chat messages the prompt was built from
    prompt_message_fields: tuple[str, ...] = ("raw_prompt", "messages")

    def install(self) -> None:
        """Nothing to hook: the user's code calls ``rlreplay.trace_op`` itself."""

    def span_kind(self, qualname: str) -> str:
        return self.kind_by_name.get(qualname.rsplit(".", 1)[-1], KIND_OP)

    def token_fields(self, kind: str) -> dict[str, tuple[str, ...]]:
        f = self.fields
        if kind == KIND_LLM:
            return {"inputs": f.llm_prompt, "output": f.llm_output + f.log_probs}
        if kind == KIND_AGENT:
            return {"inputs": (), "output": f.prompt + f.response + f.mask + f.log_probs}
        if kind == KIND_PARSER:
            return {"inputs": ("responses_ids", "response_ids", "token_ids"), "output": ()}
        return {"inputs": (), "output": ()}

    def turns(self, traj: Trajectory) -> list[Turn]:
        return segment(traj, self.fields)

    def messages(self, traj: Trajectory, decoder: BatchDecoder | None) -> list[dict[str, Any]]:
        return build_messages(self, traj, self.turns(traj), decoder)

    # -- hooks for build_messages (override per framework) --------------------------------------

    def prompt_messages(self, traj: Trajectory) -> list[dict[str, Any]] | None:
        """The chat messages the prompt was rendered from, when the agent span recorded them."""
        for span in traj.by_kind(KIND_AGENT):
            inputs = span.inputs if isinstance(span.inputs, dict) else {}
            for source in (inputs, inputs.get("kwargs")):
                if not isinstance(source, dict):
                    continue
                for key in self.prompt_message_fields:
                    value = source.get(key)
                    if isinstance(value, list) and value and all(_is_message(m) for m in value):
                        return [dict(m) for m in value]
        return None

    def tool_schemas(self, traj: Trajectory) -> list[dict[str, Any]] | None:
        """The tool schemas the prompt was rendered with: the agent span's ``tools`` input, else the
        ``tools`` a parser call was given; None when neither was recorded."""
        sources: list[Any] = []
        for span in traj.by_kind(KIND_AGENT):
            inputs = span.inputs if isinstance(span.inputs, dict) else {}
            sources += [inputs, inputs.get("kwargs")]
        sources += [s.inputs for s in traj.by_kind(KIND_PARSER)]
        for source in sources:
            tools = source.get("tools") if isinstance(source, dict) else None
            if isinstance(tools, list) and all(isinstance(t, dict) for t in tools):
                return [dict(t) for t in tools]
        return None

    def clean_text(self, role: str, text: str) -> str:
        """A decoded turn without the chat template's markers (role headers, end tokens) and,
        for the assistant, without the Hermes ``<tool_call>`` blocks (they are ``tool_calls``)."""
        if role == "assistant":
            text = _TOOL_CALL.sub("", text)
        text = _CHAT_MARKERS.sub("", text)
        return text.strip()

    def tool_texts(self, text: str) -> list[str]:
        """The tool responses inside one decoded tool turn."""
        found = _TOOL_RESPONSE.findall(text)
        if found:
            return [t.strip() for t in found]
        cleaned = self.clean_text("tool", text)
        return [cleaned] if cleaned else []

    def tool_output_text(self, output: Any) -> str | None:
        """The text a tool span returned: ``text`` of its response object, or a plain string."""
        value = output
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, dict):
            value = value.get("text", value.get("content"))
        return value if isinstance(value, str) else None

    # -- what a model, tool or parser call says about itself (audit) -----------------------------

    def call_ids(self, span: Span) -> tuple[list[int] | None, list[int] | None]:
        """(prompt ids, response ids) of a model call, None where not recorded."""
        return llm_prompt_ids(span.inputs, self.fields), llm_output_ids(span.output, self.fields)

    def stop_reason(self, span: Span) -> str | None:
        """Why a model call stopped (``stop_reason``/``finish_reason`` of its output)."""
        output = span.output if isinstance(span.output, dict) else {}
        value = first_field(output, self.fields.stop_reason)
        return value if isinstance(value, str) else None

    def max_tokens(self, span: Span) -> int | None:
        """The most tokens a model call was allowed to generate, when its request said."""
        inputs = span.inputs if isinstance(span.inputs, dict) else {}
        for source in (inputs, inputs.get("sampling_params"), inputs.get("kwargs")):
            if isinstance(source, dict):
                value = first_field(source, self.fields.max_tokens)
                if type(value) is int and value > 0:
                    return value
                nested = source.get("sampling_params")
                if isinstance(nested, dict):
                    value = first_field(nested, self.fields.max_tokens)
                    if type(value) is int and value > 0:
                        return value
        return None

    def tool_error(self, span: Span) -> str | None:
        """What went wrong in a tool call: the exception it raised, or the error text it returned."""
        if span.status == "error":
            return span.error or "raised"
        output = span.output
        if isinstance(output, dict) and output.get("error"):
            return str(output["error"])
        text = self.tool_output_text(output)
        if text is not None and _ERROR_TEXT.match(text):
            return text.strip()
        return None

    def parse_error(self, span: Span) -> str | None:
        """What went wrong in a parser call: the exception it raised, or a call it returned
        without a name or with arguments that are not a JSON object."""
        if span.status == "error":
            return span.error or "raised"
        for call in function_calls(span.output):
            if not call.get("name"):
                return "a tool call without a name"
            if not isinstance(call.get("arguments"), dict):
                return f"malformed arguments for {call.get('name')}: {str(call.get('arguments'))[:80]}"
        return None

    def tokenizer_from_argv(self, argv: list[str]) -> str | None:
        return None

    def experiment_from_argv(self, argv: list[str]) -> str | None:
        return None


_CHAT_MARKERS = re.compile(
    r"<\|im_start\|>(?:system|user|assistant|tool)?\n?|<\|im_end\|>\n?|<\|endoftext\|>|<\|eot_id\|>"
    r"|<\|start_header_id\|>\w+<\|end_header_id\|>\n*|</?s>"
)
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.S)
_ERROR_TEXT = re.compile(r"\s*(error|exception|traceback)\b", re.I)
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m


# ---- the registry ------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, FrameworkAdapter] = {}


def available() -> list[str]:
    """Names of the installed adapters."""
    return sorted(plugins.specs("adapters"))


def _instantiate(obj: Any) -> FrameworkAdapter:
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(getattr(adapter, "name", None), str):
        raise TypeError(f"{obj!r} is not a framework adapter (no name)")
    return adapter


def get_adapter(name: str | None = None) -> FrameworkAdapter:
    """The adapter registered under ``name`` (None: ``generic``); loaded once per process."""
    key = (name or DEFAULT).strip().lower()
    with _lock:
        hit = _loaded.get(key)
    if hit is not None:
        return hit
    found = plugins.specs("adapters")
    try:
        if key in found:
            adapter = _instantiate(plugins.load(found[key]))
        else:
            raise RunError(f"unknown framework {key!r}; installed adapters: {', '.join(available())}")
    except RunError:
        raise
    except Exception as exc:
        raise RunError(f"cannot load the {key!r} framework adapter: {type(exc).__name__}: {exc}") from None
    with _lock:
        return _loaded.setdefault(key, adapter)


def adapter_for_run(run: Any) -> FrameworkAdapter:
    """The adapter named by the run's manifest; ``generic`` when it names none or an uninstalled one."""
    manifest = getattr(run, "manifest", None) or {}
    name = manifest.get(MANIFEST_KEY)
    if not isinstance(name, str) or not name.strip():
        return get_adapter(DEFAULT)
    try:
        return get_adapter(name)
    except RunError as exc:
        warn = getattr(run, "warn", None)
        if callable(warn):
            warn(f"{exc}; reading with the generic adapter")
        return get_adapter(DEFAULT)


def turns(
    traj: Trajectory, decoder: BatchDecoder | None = None, adapter: FrameworkAdapter | None = None
) -> list[Turn]:
    """The trajectory's turns in order, as its framework adapter splits them (default: generic).

    With ``decoder``, ``text`` is filled in one batched call.
    """
    if adapter is None:
        adapter = get_adapter()
    result = adapter.turns(traj)
    if decoder is not None and result:
        texts = decoder.decode_many([t.token_ids for t in result], skip_special_tokens=False)
        for turn, text in zip(result, texts):
            turn.text = text
    return result


def openai_messages(
    traj: Trajectory, decoder: BatchDecoder | None = None, adapter: FrameworkAdapter | None = None
) -> list[dict[str, Any]]:
    """The trajectory's conversation in OpenAI chat format, as its adapter builds it (default: generic)."""
    if adapter is None:
        adapter = get_adapter()
    return adapter.messages(traj, decoder)
