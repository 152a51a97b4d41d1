"""One walk of a span's payload: the same JSON as to_jsonable then redact_data, and its token id count."""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from collections.abc import Mapping
from typing import Any

import numpy as np
import pydantic

from rlreplay.format import payload, redact

URL = "https://alice:pa55-Word-7c1e9b@git.example.com/r.git"


class Turn(pydantic.BaseModel):
    prompt_ids: list[int]
    text: str


@dataclasses.dataclass
class Call:
    response_ids: list[int]
    api_key: str


Pair = namedtuple("Pair", ["token_ids", "note"])


class Broken:
    def __iter__(self) -> Any:
        raise RuntimeError("no iteration")

    def keys(self) -> Any:
        raise RuntimeError(f"cannot list keys of {URL}")

    def __repr__(self) -> str:
        return f"Broken({URL})"


class Hostile(list):
    def __iter__(self) -> Any:
        raise RuntimeError(f"cannot read {URL}")


class HalfMapping(Mapping):
    """Yields one entry with ids, then fails: its walk ends in an error marker."""

    def __getitem__(self, key: str) -> Any:
        return [1, 2, 3]

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Any:
        yield "input_ids"
        raise RuntimeError(f"gone {URL}")


def _count(data: Any) -> int:
    """Items of lists under keys ending in ``ids``, through mappings only (what a span's
    num_tokens has always counted)."""
    if not isinstance(data, dict):
        return 0
    total = 0
    for key, value in data.items():
        if isinstance(key, str) and key.endswith("ids") and isinstance(value, list):
            total += len(value)
        elif isinstance(value, dict):
            total += _count(value)
    return total


PAYLOADS = [
    {"prompt_ids": list(range(100)), "sampling_params": {"temperature": 1.0}},
    {"token_ids": list(range(2000)), "text": f"see {URL}", "log_probs": [-0.5] * 80},
    {"outer": {"input_ids": [1, 2, 3], "deeper": {"output_ids": list(range(70))}}},
    {"api_key": {"input_ids": [1, 2, 3]}, "password": "hunter22", "max_tokens": 5, "token": ""},
    {"turns": [{"prompt_ids": [1, 2]}], "ids": (1, 2, 3), "more_ids": [[1, 2], [3]]},
    {"turn": Turn(prompt_ids=list(range(90)), text=URL), "call": Call([5, 6], "sk-secret-value")},
    {"pair": Pair([1, 2, 3], URL), "set": {URL, "plain"}, "bytes": b"\x00\x01", "nan": math.nan},
    {"array_ids": np.arange(80, dtype=np.int64), "floats": np.zeros(3, dtype=np.float32)},
    {"broken": Broken(), "after_ids": [7, 8], 3: "int key", None: "none key"},
    {"hostile": Hostile([1, 2]), "half": HalfMapping(), "kept_ids": [4, 5]},
    [{"prompt_ids": [1, 2, 3]}, URL],
    URL,
    12,
    None,
]


def test_one_walk_matches_to_jsonable_then_redaction() -> None:
    for value in PAYLOADS:
        issues_a: list[str] = []
        issues_b: list[str] = []
        expected = redact.redact_data(payload.to_jsonable(value, issues=issues_a))
        got, count = payload.to_payload(value, issues_b)
        assert payload.dumps(got) == payload.dumps(expected), value
        assert count == _count(expected), value
        assert issues_b == issues_a
    hostile = payload.to_payload({"h": Hostile([1]), "half": HalfMapping(), "kept_ids": [4, 5]})
    assert hostile[0]["h"]["__type__"] == hostile[0]["half"]["__type__"] == "error"
    assert "pa55" not in payload.dumps(hostile[0]) and hostile[1] == 2


def test_lists_that_begin_with_a_number_are_redacted_too() -> None:
    data, count = payload.to_payload({"row": [200, URL, {"access_token": "abcdefgh"}], "ids": [1, 2]})
    assert data == {"row": [200, "https://***@git.example.com/r.git", {"access_token": "***"}], "ids": [1, 2]}
    assert count == 2


def test_number_lists_are_kept_as_given_and_listed_for_arrays() -> None:
    ids = list(range(500))
    kinds: dict[int, Any] = {}
    data, count = payload.to_payload({"prompt_ids": ids}, kinds=kinds)
    assert data["prompt_ids"] is ids and count == 500
    assert kinds[id(ids)] == (ids, int)
