"""Span kinds, the one place they are spelled: what a recorded call was (model call, tool call, ...).

Imports nothing: recording processes and framework adapters read it before pyarrow loads.
"""

from __future__ import annotations

#: The trajectory's root span.
KIND_TRAJECTORY = "trajectory"
#: An agent loop: the conversation's prompt, response and mask live in its output.
KIND_AGENT = "agent"
#: A model call.
KIND_LLM = "llm"
#: A tool call.
KIND_TOOL = "tool"
#: A tool-call parser.
KIND_PARSER = "parser"
#: Any other traced call.
KIND_OP = "op"
#: Training signals written by another process (the trainer) for an existing trajectory.
KIND_SIGNALS = "signals"
