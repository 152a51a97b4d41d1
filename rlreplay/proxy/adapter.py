"""The framework adapter of runs the proxy records (``run.json``: ``"framework": "proxy"``).

A proxied generation is an ``llm`` span whose inputs are the request as the client sent it plus
``prompt_ids`` (what the upstream said the prompt was) and whose output holds ``token_ids``,
``log_probs`` and ``finish_reason`` beside the answer: the generic adapter reads all of it. Both
keep the bytes that went over the wire under ``wire``.

For the mismatch numbers a trajectory's response is its calls' generated tokens in call order, each
with the log-prob the upstream gave it; the trainer's log-probs (``POST /rlreplay/signals`` with
``{"output": {"old_log_probs": [...]}}``) come one per such token. In replay, ``prompt_ids`` came
from the upstream, not from the client, SGLang's ``rid`` is a per-request id, and ``wire`` holds the
request's bytes, whose values are compared: none of them is compared.
"""

from __future__ import annotations

from rlreplay.adapters.generic import GenericAdapter
from rlreplay.text.conversation import RESPONSE_IN_CALLS, ConversationFields


class ProxyAdapter(GenericAdapter):
    """Runs recorded by ``rlreplay proxy``: the generic reading, the response in the model calls,
    and the proxy's volatile inputs."""

    name = "proxy"
    fields = ConversationFields(response_in=RESPONSE_IN_CALLS)

    def volatile_keys(self) -> frozenset[str]:
        return super().volatile_keys() | {"prompt_ids", "rid", "wire"}
