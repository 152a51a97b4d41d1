"""A span's inputs are the call's arguments bound as ``inspect`` binds them (defaults applied, in
parameter order, ``self`` left out), and a call that does not bind is recorded as given."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from rlreplay.recorder.events import OpMeta


def plain(request_id, prompt_ids, sampling_params=None, *, image_data=None, tag="x"): ...


def varargs(a, *rest, b=2, **extra): ...


def positional_only(a, /, b=1): ...


class Server:
    def generate(self, prompt_ids, sampling_params, request_id=None): ...


def expected(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return {"args": list(args), **kwargs}
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    if next(iter(inspect.signature(fn).parameters), None) == "self":
        inputs.pop(next(iter(inputs)))
    return inputs


CALLS = [
    (plain, ("r1", [1, 2]), {}),
    (plain, ("r1",), {"prompt_ids": [1], "tag": "y"}),
    (plain, (), {"tag": "y", "prompt_ids": [1], "request_id": "r"}),
    (plain, ("r1", [1], {"t": 1}), {"image_data": b"x"}),
    (plain, ("r1",), {}),  # missing: recorded as given
    (plain, ("r1", [1]), {"request_id": "again"}),  # twice
    (plain, ("r1", [1]), {"unknown": 1}),
    (plain, ("r1", [1], None, "extra"), {}),  # too many
    (varargs, (1, 2, 3), {"c": 4}),
    (varargs, (1,), {}),
    (positional_only, (1,), {"b": 3}),
    (positional_only, (), {"a": 1}),
    (Server.generate, (Server(), [1, 2], {"t": 1}), {}),
    (Server.generate, (Server(),), {"sampling_params": {}, "prompt_ids": [3]}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), CALLS)
def test_inputs_are_bound_as_inspect_binds_them(fn: Any, args: tuple, kwargs: dict) -> None:
    meta = OpMeta(name="op", fn=fn)
    for _ in range(2):  # the first call learns the signature
        got = meta.bind(args, kwargs)
        want = expected(fn, args, kwargs)
        assert got == want and list(got) == list(want)
