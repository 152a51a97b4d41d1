"""The generic framework adapter: any agent loop recorded with ``rlreplay.trace_op``, and the base
every framework's adapter subclasses (``rlreplay.hookspecs.FrameworkAdapter`` says what it provides).

Span kinds come from method names; the conversation from the agent span's ``prompt_ids``,
``response_ids`` and ``response_mask`` (or the ``llm`` spans alone); chat messages from the
Hermes/ChatML template's markers. Imports no pyarrow: recording processes load it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from rlreplay.format import payload, tool_errors
from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_OP, KIND_PARSER, KIND_TOOL
from rlreplay.text.conversation import (
    ConversationFields,
    first_field,
    function_calls,
    llm_output_ids,
    llm_prompt_ids,
    segment,
)
from rlreplay.text.messages import build_messages

if TYPE_CHECKING:
    from rlreplay.model import Span, Trajectory
    from rlreplay.text.conversation import BatchDecoder, Turn


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

    #: output keys that differ between two runs of the same rollout: none known
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
        return tool_errors.output_text(output)

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
        """What went wrong in a tool call: the exception it raised, or the failure its result
        reports, by the one definition the listing counts (``rlreplay.format.tool_errors``)."""
        return tool_errors.tool_error(span.status, span.error, span.output)

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

    # -- replay ---------------------------------------------------------------------------------

    def output_builders(self) -> dict[str, Any]:
        """The types a replay rebuilds beyond ``payload.BUILTIN_TYPES``: qualified class -> a
        builder from the decoded JSON value (a framework's adapter names its own)."""
        return {}

    def rebuild_output(self, name: str, kind: str, output: Any, output_type: dict[str, str] | None) -> Any:
        """What the op returned: the JSON form decoded, tuples, sets and bytes as they were, and the
        types of :meth:`output_builders` rebuilt; ``payload.NotExact`` for anything else (an object
        of another class, a truncated or redacted value). Outputs recorded before outputs had a
        type record (``output_type`` None) are served as their JSON values."""
        return payload.from_json(output, output_type, self.output_builders())

    def volatile_keys(self) -> frozenset[str]:
        """Per-call ids, fresh on every run by design: never compared."""
        return _PER_CALL_IDS

    def tokenizer_from_argv(self, argv: list[str]) -> str | None:
        return None

    def experiment_from_argv(self, argv: list[str]) -> str | None:
        return None


_CHAT_MARKERS = re.compile(
    r"<\|im_start\|>(?:system|user|assistant|tool)?\n?|<\|im_end\|>\n?|<\|endoftext\|>|<\|eot_id\|>"
    r"|<\|start_header_id\|>\w+<\|end_header_id\|>\n*|</?s>"
)
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.S)
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m


_PER_CALL_IDS = frozenset({"request_id", "instance_id"})
