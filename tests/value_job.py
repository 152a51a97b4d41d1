"""A job whose model call returns, per trajectory, one value of a list: for the compare and export tests.

``python value_job.py CONFIG_FILE``: the file holds ``{"values": [{"a": ..., "b": ...}, ...]}``, each
side in the small encoding :func:`decode` reads (floats by their bits, so that NaN payloads and
``-0.0`` travel exactly). Trajectory ``i`` (step 0, sample_index ``i``) calls ``Engine.generate``
once, which returns value ``i`` of side ``$VALUE_JOB_SIDE`` (default ``a``); with
``$VALUE_JOB_ENGINE_DOWN`` set the engine refuses to answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from typing import Any

import rlreplay

NAME = "Engine.generate"


def encode(value: Any) -> Any:
    """``value`` (floats, ints, str, bool, None, bytes, lists, dicts) in the encoding :func:`decode` reads."""
    cls = type(value)
    if cls is float:
        return {"f": struct.pack("<d", value)[::-1].hex()}
    if cls is int:
        return {"i": str(value)}
    if cls is bytes:
        return {"b": value.hex()}
    if cls is list:
        return {"l": [encode(v) for v in value]}
    if cls is dict:
        return {"d": {k: encode(v) for k, v in value.items()}}
    return value  # str, bool, None


def decode(data: Any) -> Any:
    if isinstance(data, dict):
        [(tag, inner)] = data.items()
        if tag == "f":
            return struct.unpack("<d", bytes.fromhex(inner)[::-1])[0]
        if tag == "i":
            return int(inner)
        if tag == "b":
            return bytes.fromhex(inner)
        if tag == "l":
            return [decode(v) for v in inner]
        return {k: decode(v) for k, v in inner.items()}
    return data


class Engine:
    def __init__(self, replies: list[Any]) -> None:
        self.replies = replies

    @rlreplay.trace_op(name=NAME, kind="llm")
    def generate(self, prompt_ids: list[int], sample: int) -> Any:
        if os.environ.get("VALUE_JOB_ENGINE_DOWN"):
            raise ConnectionError("no model server")
        return self.replies[sample]


def main(config_file: str) -> None:
    side = os.environ.get("VALUE_JOB_SIDE", "a")
    with open(config_file) as f:
        values = [decode(v[side]) for v in json.load(f)["values"]]
    engine = Engine(values)
    for i in range(len(values)):
        with rlreplay.trajectory(step=0, sample_index=i, rollout_n=0), contextlib.suppress(ConnectionError):
            engine.generate([1, 2, i], sample=i)


if __name__ == "__main__":
    main(sys.argv[1])
