"""``rlreplay proxy --tokenizer`` keeps the tokenizer's files in its run as ``record`` does: the run
decodes and renders its chat template on a machine without the model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from support import free_port, qwen_tokenizer_dir

# what `record` keeps of a tokenizer folder: tokenizer.json makes vocab.json and merges.txt unneeded
KEPT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_folder(path: Path) -> dict[str, bytes]:
    """A model folder with a tokenizer (and a model file that is not one); the tokenizer files' bytes."""
    shutil.copytree(qwen_tokenizer_dir(), path)
    (path / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    (path / "chat_template.jinja").write_text("{{ 'proxy' }}")
    (path / "config.json").write_text("{}")
    return {name: (path / name).read_bytes() for name in KEPT}


def test_proxy_keeps_the_tokenizer_files_in_its_run(start_proxy: Any, tmp_path: Path) -> None:
    expected = model_folder(tmp_path / "model")
    closed = f"http://127.0.0.1:{free_port()}"  # no call is made: the files are kept on start
    proxy = start_proxy("--upstream", closed, "--out", "run", "--tokenizer", str(tmp_path / "model"))
    run = tmp_path / "run"
    assert json.loads((run / "run.json").read_text())["tokenizer_snapshot"] == sorted(expected)
    assert proxy.stop() == 0, proxy.stderr
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["tokenizer_snapshot"] == sorted(expected)
    for name, data in expected.items():  # byte for byte
        assert (run / name).read_bytes() == data, name
    for name in ("vocab.json", "merges.txt", "config.json"):
        assert not (run / name).exists(), name
    shutil.rmtree(tmp_path / "model")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run)  # the run folder is a tokenizer folder
    assert tok.decode(tok.encode("Name a colour.")) == "Name a colour."
    assert tok.chat_template == "{{ 'proxy' }}"


def test_proxy_keeps_a_tokenizer_that_appears_while_it_runs(start_proxy: Any, tmp_path: Path) -> None:
    """A tokenizer not on the machine at start (the server fetches the model later) is kept at the end;
    one never found is named in one line."""
    later = tmp_path / "fetched"
    proxy = start_proxy(
        "--upstream", f"http://127.0.0.1:{free_port()}", "--out", "run", "--tokenizer", str(later)
    )
    assert "tokenizer_snapshot" not in json.loads((tmp_path / "run" / "run.json").read_text())
    expected = model_folder(later)
    assert proxy.stop() == 0, proxy.stderr
    assert "keeps no copy" not in proxy.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["tokenizer_snapshot"] == sorted(expected)

    gone = start_proxy(
        "--upstream",
        f"http://127.0.0.1:{free_port()}",
        "--out",
        "none",
        "--tokenizer",
        "no-such-org/no-such-model",
    )
    assert gone.stop() == 0, gone.stderr
    notes = [line for line in gone.stderr.splitlines() if "keeps no copy" in line]
    assert len(notes) == 1 and "no-such-org/no-such-model" in notes[0] and "Traceback" not in gone.stderr, (
        gone.stderr
    )
    assert "tokenizer_snapshot" not in json.loads((tmp_path / "none" / "run.json").read_text())
