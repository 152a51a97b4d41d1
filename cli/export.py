"""``rlreplay export``: selected trajectories as a chat dataset (JSON lines or Parquet)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from rlreplay.cli.app import (
    EngineOption,
    FindingOption,
    ForceOption,
    RayAddressOption,
    RunArgument,
    RunOption,
    TokenizerOption,
    app,
    cluster_for,
    fail,
    flagged,
    open_run_arg,
    output_path,
    report_warnings,
    selection_options,
    trajectories,
    whole_number,
    write_atomically,
)

_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@app.command("export")
@selection_options
def export_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", metavar="FILE", help="File to write (never inside a run).")
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option("--format", metavar="FORMAT", help="jsonl or parquet (default: from the --out suffix)."),
    ] = None,
    max_samples: Annotated[
        str | None,
        typer.Option(
            "--max-samples",
            metavar="N",
            help="Per step and split, at most N samples (seeded choice), each with all of its rollouts.",
        ),
    ] = None,
    seed: Annotated[str, typer.Option("--seed", metavar="N", help="Seed of the --max-samples choice.")] = "0",
    tokenizer: TokenizerOption = None,
    token_ids: Annotated[
        bool, typer.Option("--token-ids", help="Also write prompt_ids, response_ids and response_mask.")
    ] = False,
    logprobs: Annotated[
        bool,
        typer.Option(
            "--logprobs",
            help="Also write rollout_log_probs (per response token) and trainer_log_probs (the "
            "trainer's, when recorded with record --token-signals).",
        ),
    ] = False,
    finding: FindingOption = None,
    old_ids: Annotated[bool, typer.Option("--ids", hidden=True)] = False,
    force: ForceOption = False,
    engine_name: EngineOption = "local",
    ray_address: RayAddressOption = None,
    *,
    selection: Any,
) -> None:
    """Write the selection as a dataset (JSON lines or Parquet).

    One record per trajectory: keys, reward, advantage, messages in OpenAI chat format and tools
    (the tool schemas the prompt was rendered with, as a JSON array); per-token fields on request."""
    from rlreplay import export
    from rlreplay.read import selection as choosing
    from rlreplay.text.token2text import Decoder, resolve_tokenizer

    if old_ids:
        print(
            "rlreplay: export --ids is now --token-ids (--ids means token ids instead of text)",
            file=sys.stderr,
        )
        token_ids = True
    samples = whole_number("--max-samples", max_samples, minimum=1)
    seed_value = whole_number("--seed", seed)
    if out is None:
        fail("--out FILE is required (FILE.jsonl or FILE.parquet)")
    if fmt is None:
        fmt = _SUFFIXES.get(out.suffix.lower())
        if fmt is None:
            fail(f"--format: give jsonl or parquet (no format for the suffix of {out})")
    if fmt not in export.FORMATS:
        fail(f"--format must be one of: {', '.join(export.FORMATS)} (got {fmt!r})")
    target = output_path(out, force)
    cluster = cluster_for(engine_name, ray_address)
    opened = open_run_arg(run, run_path)
    name = resolve_tokenizer(opened, tokenizer)
    if name is None:
        fail("export writes decoded text and no tokenizer is known for this run; pass --tokenizer PATH")
    decoder = Decoder.load(name)
    keep = None if finding is None else lambda table: flagged(opened, table, finding)
    texts = None
    if selection.grep is not None and cluster is not None:
        from rlreplay.engine import Search

        texts = Search(opened, tokenizer, cluster)
    elif selection.grep is not None:
        from rlreplay.read.search import TextSearch

        texts = TextSearch(opened, decoder)
    # --grep's parts and the export's on one connection to the cluster
    with cluster.held() if cluster is not None else contextlib.nullcontext():
        listing = selection.trajectories(opened, keep=keep, texts=texts)
        if samples is not None:
            groups = choosing.sample_groups(listing, samples, seed_value or 0)
            chosen = choosing.group_ids(groups)
            if chosen:
                print(f"--max-samples {samples} chose {choosing.describe_groups(groups)}", file=sys.stderr)
        else:
            chosen = listing["id"].to_pylist()
        if not chosen:
            report_warnings(opened)
            print(f"rlreplay: no trajectories selected in {opened.path}; nothing written", file=sys.stderr)
            raise typer.Exit(1)
        written = 0

        def run_export(tmp: Path) -> None:
            nonlocal written
            batches = None
            if cluster is not None:
                from rlreplay.engine import export_batches

                batches = export_batches(opened, listing, chosen, tokenizer, token_ids, logprobs, cluster)
            written = export.write(
                tmp,
                fmt,
                opened,
                listing,
                chosen,
                decoder,
                with_ids=token_ids,
                with_logprobs=logprobs,
                batches=batches,
            )

        write_atomically(target, run_export)
    report_warnings(opened)
    print(f"wrote {trajectories(written)} to {target} ({fmt})", file=sys.stderr)
