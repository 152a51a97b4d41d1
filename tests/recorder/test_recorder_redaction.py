"""Secrets in traced calls never reach a shard: the same rules for inputs, outputs and errors."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pyarrow.parquet as pq

import rlreplay
from rlreplay.shards.layout import list_files

SECRET = "pa55-Word-7c1e9b"
URL = f"https://alice:{SECRET}@git.example.com/org/repo.git"
SHOWN = "https://***@git.example.com/org/repo.git"


@rlreplay.trace_op(kind="tool")
def fetch(url: str) -> dict:
    return {"echo": f"cloned {url}", "urls": [url], "api_key": SECRET, "status": 200}


@rlreplay.trace_op(kind="tool")
def echo(text: str) -> str:
    return text


@rlreplay.trace_op(kind="parser")
def parse(text: str) -> list:
    return [{"remote": text.split()[-1]}]


@rlreplay.trace_op(kind="tool")
def fail(url: str) -> None:
    raise ConnectionError(f"could not reach {url}")


@rlreplay.trace_op(kind="llm")
def generate(prompt_ids: list[int]) -> dict:
    return {"token_ids": [i + 7 for i in prompt_ids], "text": f"see {URL}"}


def test_urls_and_secret_names_are_hidden_in_inputs_outputs_and_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rlreplay.init(run, experiment="redaction", worker="w0")
    prompt = list(range(40, 140))
    try:
        with rlreplay.trajectory(step=0, sample_index=0):
            fetch(URL)
            echo(f"the remote is {URL}")
            parse(f"git remote add origin {URL}")
            with contextlib.suppress(ConnectionError):
                fail(URL)
            generate(prompt)
        assert rlreplay.flush()
    finally:
        rlreplay.close()

    sealed, partials = list_files(run)
    assert sealed and not partials
    raw = b"".join(path.read_bytes() for path in sealed)
    assert SECRET.encode() not in raw  # nowhere in the shard, compressed or not
    for path in sealed:
        table = pq.ParquetFile(path).read(columns=["inputs", "output", "error"])
        for column in table.column_names:
            for text in table[column].to_pylist():
                assert text is None or SECRET not in text, (column, text)

    (traj_id,) = rlreplay.open_run(run).trajectories()["id"].to_pylist()
    spans = {s.name.rsplit(".", 1)[-1]: s for s in rlreplay.open_run(run).trajectory(traj_id).spans}
    assert spans["fetch"].inputs == {"url": SHOWN}
    assert spans["fetch"].output == {
        "echo": f"cloned {SHOWN}",
        "urls": [SHOWN],
        "api_key": "***",
        "status": 200,
    }
    assert spans["echo"].output == f"the remote is {SHOWN}"
    assert spans["parse"].output == [{"remote": SHOWN}]
    assert SECRET not in str(spans["fail"].output) and SHOWN in spans["fail"].output["message"]
    assert spans["generate"].output["text"] == f"see {SHOWN}"
    # model token ids are never touched: the ids come back as they went in
    assert list(spans["generate"].inputs["prompt_ids"]) == prompt
    assert list(spans["generate"].output["token_ids"]) == [i + 7 for i in prompt]


class _Remote:
    def __repr__(self) -> str:
        return f"Remote({URL})"


@rlreplay.trace_op(kind="tool")
def rows_of(url: str) -> dict:
    # a list that begins with a number, a secret beside ids, an object kept as its repr
    return {"row": [200, url, {"access_token": SECRET}], "remote": _Remote(), "input_ids": list(range(70))}


def test_urls_after_a_number_and_in_reprs_are_hidden(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rlreplay.init(run, experiment="redaction", worker="w0")
    try:
        with rlreplay.trajectory(step=0, sample_index=0):
            rows_of(URL)
        assert rlreplay.flush()
    finally:
        rlreplay.close()

    sealed, _ = list_files(run)
    assert SECRET.encode() not in b"".join(path.read_bytes() for path in sealed)
    (traj_id,) = rlreplay.open_run(run).trajectories()["id"].to_pylist()
    (span,) = [s for s in rlreplay.open_run(run).trajectory(traj_id).spans if s.name.endswith("rows_of")]
    assert span.output["row"] == [200, SHOWN, {"access_token": "***"}]
    assert span.output["remote"]["repr"] == f"Remote({SHOWN})"
    assert list(span.output["input_ids"]) == list(range(70))
    assert span.num_tokens == 70
