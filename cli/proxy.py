"""``rlreplay proxy``: record (or replay) model calls at the inference server, for any framework."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any

import typer

from rlreplay.cli.app import EXPERIMENT_NAME, ExperimentNameWas, TokenizerOption, app, fail
from rlreplay.cli.launch import (
    DEFAULT_MATCH_ON,
    DEFAULT_ON_DIVERGE,
    MatchOnOption,
    OnDivergeOption,
    OutOption,
)
from rlreplay.errors import install_hint

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _upstream(url: str | None) -> str | None:
    if url is None:
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"--upstream {url!r}: give the server's base URL, like http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        fail(f"--upstream {url!r}: the port is not a number from 0 to 65535")
    if parts.path.rstrip("/") or parts.query or parts.fragment:
        fail(f"--upstream {url!r}: give the server's base URL without a path (the client's path is kept)")
    return url.rstrip("/")


@app.command("proxy")
def proxy_command(
    upstream: Annotated[
        str | None,
        typer.Option(
            "--upstream",
            metavar="URL",
            help="The inference server (vLLM, SGLang, any OpenAI-compatible one), e.g. http://127.0.0.1:8000.",
        ),
    ] = None,
    out: OutOption = None,
    port: Annotated[int, typer.Option("--port", metavar="PORT", help="Port (0: any free port).")] = 8100,
    host: Annotated[
        str, typer.Option("--host", metavar="HOST", help="Address to listen on (default: this machine only).")
    ] = "127.0.0.1",
    replay: Annotated[
        str | None,
        typer.Option("--replay", metavar="RUN", help="Answer calls from this recorded proxy run."),
    ] = None,
    on_diverge: OnDivergeOption = DEFAULT_ON_DIVERGE,
    match_on: MatchOnOption = DEFAULT_MATCH_ON,
    experiment: Annotated[
        str | None,
        typer.Option(
            "--experiment-name", "-e", metavar="NAME", help="Experiment name recorded with the run."
        ),
    ] = None,
    experiment_was: ExperimentNameWas = None,
    tokenizer: TokenizerOption = None,
    idle_close: Annotated[
        float,
        typer.Option(
            "--idle-close",
            metavar="SECONDS",
            help="Write a trajectory once it has had no call for this long (and when the proxy stops).",
        ),
    ] = 300.0,
    readers: Annotated[
        int | None,
        typer.Option(
            "--readers",
            metavar="N",
            help="Processes that read what is recorded of each answer while the proxy forwards "
            "(0: the proxy's own; default: one per spare core, 2 to 4).",
        ),
    ] = None,
) -> int:
    """Record (or replay) model calls at the inference server.

    Every generation that passes through becomes an llm span of a trajectory of a run.

    Forwards OpenAI-compatible /v1/chat/completions and /v1/completions (streaming too) and SGLang's
    /generate to --upstream, recording prompt and response token ids, log-probs, finish reason,
    usage and engine metadata; every other route passes through unchanged. Keys and auth headers
    pass through and are never stored. A call names its trajectory with the header
    X-Rlreplay-Trajectory: step=3,sample_index=12,rollout_n=0 (or joins the one whose prompt it
    extends); weight updates (or POST /rlreplay/step) advance the step; POST /rlreplay/signals
    records rewards. With --replay RUN, calls are answered from that recording instead.
    """
    try:
        import aiohttp  # noqa: F401
        import msgspec  # noqa: F401
    except ImportError as exc:
        fail(f"rlreplay proxy needs the 'proxy' extra ({exc.name} is missing): {install_hint('proxy')}")
    upstream = _upstream(upstream)
    if upstream is None and replay is None:
        fail("give --upstream URL (the inference server), or --replay RUN to answer from a recording")
    if not 0 <= port <= 65535:
        fail(f"--port {port}: not a port number (0 to 65535)")
    if idle_close <= 0:
        fail(f"--idle-close {idle_close}: give a number of seconds above 0")
    if readers is not None and not 0 <= readers <= 64:
        fail(f"--readers {readers}: give a number of processes from 0 to 64")
    experiment = EXPERIMENT_NAME.take(experiment, experiment_was)
    return run_proxy(
        upstream, out, port, host, replay, on_diverge, match_on, experiment, idle_close, tokenizer, readers
    )


def run_proxy(
    upstream: str | None,
    out: str | None,
    port: int,
    host: str,
    replay: str | None,
    on_diverge: str,
    match_on: str,
    experiment: str | None,
    idle_close: float,
    tokenizer: str | None = None,
    readers: int | None = None,
) -> int:
    import asyncio

    import rlreplay
    from rlreplay.cli.record import default_out, keep_tokenizer, keep_tokenizer_at_end, snapshot_fields
    from rlreplay.errors import RlreplayError
    from rlreplay.format import manifest
    from rlreplay.proxy.guard import GuardSettings
    from rlreplay.proxy.replaying import ProxyReplay
    from rlreplay.proxy.server import Proxy, ProxySettings, listen, serve
    from rlreplay.proxy.trajectories import Trajectories
    from rlreplay.remote import location

    cassette = config = None
    kept: list[str] = []
    if replay is not None:
        from rlreplay.playback import ReplayConfig, open_source, source_framework

        try:
            config = ReplayConfig.of(replay, "llm", None, on_diverge, match_on)
            source = open_source(replay)
            if source_framework(source) != "proxy":
                fail(
                    f"--replay {source.address}: not a run recorded by rlreplay proxy "
                    f"(it was recorded with the {source_framework(source)} adapter)"
                )
            cassette = ProxyReplay(config.cassette(source))
        except RlreplayError as exc:
            fail(str(exc))
    try:  # the port first: one in use leaves no run behind (it would become the default run)
        sock = listen(host, port)
    except RlreplayError as exc:
        fail(str(exc))
    command = ["rlreplay", "proxy", *sys.argv[2:]] if sys.argv[1:2] == ["proxy"] else ["rlreplay", "proxy"]
    extra: dict[str, Any] = {"framework": "proxy", "proxy": {"upstream": location.redact(upstream or "")}}
    if tokenizer is not None:  # the model's tokenizer, for reading the recorded ids as text
        extra["tokenizer"] = tokenizer
    if config is not None:
        extra["replay"] = config.record()
    uri = location.as_uri(out)
    if uri is None:
        run_dir = location.local_path(out) if out else default_out(["proxy"], experiment)
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            fail(
                f"{run_dir} already exists and is not an empty directory; recorded runs are never overwritten"
            )
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"--out {run_dir}: cannot create the run there ({exc.strerror or exc})")
        kept, _ = keep_tokenizer(tokenizer, run_dir)  # as `record` does: the run decodes on any machine
        manifest.write_json_atomic(
            run_dir / manifest.MANIFEST,
            manifest.new_manifest(experiment, command, status="running", **extra, **snapshot_fields(kept)),
        )
        target: str = str(run_dir)
    else:
        target = uri
    recorder = rlreplay.init(target, experiment=experiment, worker="proxy")
    if uri is not None:
        manifest.update_manifest(recorder.config.run_dir, status="running", **extra)
    trajectories = Trajectories(recorder, idle_s=idle_close, experiment=experiment)
    if cassette is not None:
        for key in cassette.recorded_keys():
            trajectories.reserve(key.step, key.sample_index)
    settings = ProxySettings(upstream, cassette, guard=GuardSettings(host=host), readers=readers)
    proxy = Proxy(settings, trajectories)

    def ready(url: str) -> None:
        print(
            f"rlreplay proxy: listening on {url}"
            + (f", forwarding to {location.redact(upstream)}" if upstream else "")
            + (f", answering from {config.source}" if config is not None else "")
            + f"; recording into {location.redact(target)}",
            file=sys.stderr,
            flush=True,
        )
        if host not in LOOPBACK:
            print(
                f"rlreplay: warning: listening on {host}: anyone who can reach it can use the upstream "
                "through this proxy",
                file=sys.stderr,
                flush=True,
            )

    code = 0
    try:
        asyncio.run(serve(proxy, host, port, ready, sock=sock))
    except RlreplayError as exc:
        print(f"rlreplay: error: {exc}", file=sys.stderr)
        code = 2
    finally:
        rlreplay.close()
        if uri is None:
            kept = keep_tokenizer_at_end(tokenizer, run_dir, kept)
            manifest.update_manifest(
                run_dir,
                **snapshot_fields(kept),
                status="finished" if code == 0 else "failed",
                ended_at=time.time(),
            )
    if cassette is not None:
        print(f"rlreplay: replay of {config.source}: {cassette.summary()}", file=sys.stderr)
    return code
