"""The framework adapter of runs the proxy records (``run.json``: ``"framework": "proxy"``).

A proxied generation is an ``llm`` span whose inputs are the request as the client sent it plus
``prompt_ids`` (what the upstream said the prompt was) and whose output holds ``token_ids``,
``log_probs`` and ``finish_reason`` beside the answer: the generic adapter reads all of it. What
differs is replay: ``prompt_ids`` came from the upstream, not from the client, and SGLang's
``rid`` is a per-request id, so neither is compared.
"""

from __future__ import annotations

from rlreplay.adapters.generic import GenericAdapter


class ProxyAdapter(GenericAdapter):
    """Runs recorded by ``rlreplay proxy``: the generic reading, with the proxy's volatile inputs."""

    name = "proxy"

    def volatile_keys(self) -> frozenset[str]:
        return super().volatile_keys() | {"prompt_ids", "rid"}
