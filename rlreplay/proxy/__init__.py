"""``rlreplay proxy``: record and replay model calls at the inference server, for any RL framework.

A proxy in front of an OpenAI-compatible server (vLLM, SGLang) or SGLang's native ``/generate``
records each generation as an ``llm`` span of an ordinary run (prompt and response token ids,
log-probs, finish reason, usage, engine metadata), and can answer from a recording instead of the
server, with the same matching as ``rlreplay replay``. ``protocol`` knows the servers' request and
response shapes, ``trajectories`` joins calls into trajectories and steps, ``server`` is the HTTP
face (aiohttp, loaded only by ``rlreplay proxy``), ``adapter`` reads proxy runs.
"""
