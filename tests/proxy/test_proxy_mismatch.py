"""``rlreplay mismatch``, the audit's mismatch check and the UI's mismatch page on a run the proxy
recorded: the rollout's log-probs are what the model server (standing in for vLLM/SGLang, which need
GPUs) returned through the proxy, the trainer's arrive through ``POST /rlreplay/signals``; every
number is checked against numpy over the log-probs the client itself received."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from proxy.conftest import ProxyProcess
from support import rlreplay_proc

from rlreplay.proxy.protocol import stream_chunks

pytestmark = pytest.mark.timeout(900)
EPS = 1e-8  # verl's epsilon in the token count (compute_offpolicy_metrics)
#: trajectory key -> the chat turns it makes (max_tokens of each) and the trainer's shift per token
PLAN = {
    (1, 0): ((5, 3), "small"),  # two model calls: the response is both calls' tokens, in call order
    (1, 1): ((6,), "small"),
    (2, 0): ((4,), "far"),  # the trainer one nat above the rollout on every token: broken
    (2, 1): ((3,), None),  # no signals: left out, with a note
}


#: trajectories whose calls stream (as vLLM streams: a role-only first chunk, then a chunk per token)
STREAMED = {(1, 0), (2, 0)}


def _chat(proxy: str, key: tuple[int, int], sizes: tuple[int, ...]) -> list[float]:
    """The trajectory's calls (each turn continues the last); the log-probs the client received."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count from {key[0] + key[1]}."}]
    rollout: list[float] = []
    streamed = key in STREAMED
    for size in sizes:
        answer = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={
                "model": "m",
                "messages": messages,
                "max_tokens": size,
                "logprobs": True,
                "stream": streamed,
            },
            headers={"X-Rlreplay-Trajectory": f"step={key[0]},sample_index={key[1]}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        if streamed:
            chunks = [c["choices"][0] for c in stream_chunks(answer.content) if isinstance(c, dict)]
            rollout += [e["logprob"] for c in chunks for e in (c.get("logprobs") or {}).get("content") or ()]
            text = "".join(c["delta"].get("content") or "" for c in chunks)
            message = {"role": "assistant", "content": text}
        else:
            choice = answer.json()["choices"][0]
            rollout += [c["logprob"] for c in choice["logprobs"]["content"]]
            message = choice["message"]
        messages += [message, {"role": "user", "content": "Go on."}]
    return rollout


def _trainer(rollout: list[float], shift: str, rng: np.random.Generator) -> np.ndarray:
    values = np.asarray(rollout, dtype=np.float64)
    if shift == "far":
        return values + 1.0
    return values + rng.normal(0.0, 0.03, len(values))


@pytest.fixture(scope="module")
def proxy_run(model_server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A proxy run with the trainer's log-probs posted as signals; per key (rollout, trainer)."""
    root = tmp_path_factory.mktemp("proxy-mismatch")
    proxy = ProxyProcess("--upstream", model_server, "--out", "runs/proxied", cwd=root)
    rng = np.random.default_rng(7)
    truth = {}
    try:
        for key, (sizes, shift) in PLAN.items():
            rollout = np.asarray(_chat(proxy.url, key, sizes), dtype=np.float64)
            trainer = _trainer(rollout.tolist(), shift, rng) if shift else None
            if trainer is not None:
                signals = httpx.post(
                    f"{proxy.url}/rlreplay/signals",
                    json={
                        "step": key[0],
                        "sample_index": key[1],
                        "reward": 1.0,
                        "output": {"old_log_probs": trainer.tolist()},
                    },
                )
                assert signals.status_code == 200, signals.text
            truth[key] = (rollout, trainer)
    finally:
        assert proxy.stop() == 0, proxy.stderr
    return root / "runs" / "proxied", truth


def _expected(responses: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """verl's and the gap's numbers over ``responses`` (every token a model token), by their definitions."""
    trainer = np.concatenate([t for _, t in responses])
    rollout = np.concatenate([r for r, _ in responses])
    ratio = trainer - rollout
    n = len(ratio)
    return {
        "sequences": len(responses),
        "tokens": n,
        "kl": -ratio.sum() / (n + EPS),
        "k3_kl": (np.exp(ratio) - ratio - 1).sum() / (n + EPS),
        "chi2_token": (np.exp(ratio) ** 2).sum() / (n + EPS) - 1,
        "logprob_diff_mean": np.abs(ratio).mean(),
        "logprob_diff_max": np.abs(ratio).max(),
        "token_mult_prob_error": np.exp(np.abs(ratio)).mean(),
        "training_ppl": np.mean([np.exp(-t.sum() / (len(t) + EPS)) for _, t in responses]),
        "rollout_ppl": np.mean([np.exp(-r.sum() / (len(r) + EPS)) for r, _ in responses]),
    }


def _by_step(truth: dict) -> dict[int, dict[str, float]]:
    steps: dict[int, list] = {}
    for (step, _), (rollout, trainer) in truth.items():
        if trainer is not None:
            steps.setdefault(step, []).append((rollout, trainer))
    return {step: _expected(found) for step, found in steps.items()}


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_mismatch_reads_the_proxy_runs_two_sides(proxy_run: tuple[Path, dict]) -> None:
    run, truth = proxy_run
    proc = rlreplay_proc("mismatch", str(run), "--json", cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    rows = {r["step"]: r for r in _json_lines(proc.stdout)}
    expected = _by_step(truth)
    assert set(rows) == set(expected)
    for step, want in expected.items():
        for name, value in want.items():
            assert rows[step][name] == pytest.approx(value, rel=1e-5, abs=1e-9), (step, name)
    assert rows[1]["verdict"] == "healthy" and rows[2]["verdict"] == "broken"
    assert "1 of 4 selected trajectories have no trainer log-probs" in proc.stderr
    # the worst token is the worst |Δ| the test made, at its place in the response
    by = _json_lines(rlreplay_proc("mismatch", str(run), "--json", "--by", "position", cwd=run.parent).stdout)
    assert sum(r["tokens"] for r in by) == sum(w["tokens"] for w in expected.values())


def test_a_proxy_run_without_trainer_log_probs_says_how_to_record_them(
    model_server: str, tmp_path: Path
) -> None:
    proxy = ProxyProcess("--upstream", model_server, "--out", "plain", cwd=tmp_path)
    _chat(proxy.url, (0, 0), (3,))
    assert proxy.stop() == 0, proxy.stderr
    proc = rlreplay_proc("mismatch", "plain", cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2 and proc.stderr == "", proc.stderr
    assert (
        "nothing to compare: no trainer log-probs per token" in lines[0] and "/rlreplay/signals" in lines[1]
    )


def test_the_audit_flags_the_broken_step_of_a_proxy_run(proxy_run: tuple[Path, dict]) -> None:
    run, truth = proxy_run
    proc = rlreplay_proc("audit", str(run), "--checks", "mismatch", "--json", cwd=run.parent)
    assert proc.returncode == 1, proc.stderr
    findings = [
        f for f in _json_lines(proc.stdout) if f.get("check") == "mismatch" and f.get("trajectory_id") is None
    ]
    want = _by_step(truth)[2]["token_mult_prob_error"]
    [broken] = findings
    assert broken["step"] == 2 and broken["severity"] == "error"
    assert f"token_mult_prob_error {want:.4g} > 2" in broken["detail"]


def test_the_ui_mismatch_page_shows_the_proxy_runs_numbers(proxy_run: tuple[Path, dict]) -> None:
    from playwright.sync_api import sync_playwright
    from ui.ui_support import CHROMIUM, serving

    from rlreplay.ui.app import create_app

    run, truth = proxy_run
    expected = _by_step(truth)
    with (
        serving(create_app(run.parent, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url,
        sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/r/{run.name}/mismatch")
            page.wait_for_selector("#mismatch-gap")
            for step, want in expected.items():
                row = page.locator(f"#mismatch-gap tr[data-step='{step}'][data-split='train']")
                for name in ("logprob_diff_mean", "logprob_diff_max", "token_mult_prob_error"):
                    shown = float(row.locator(f"td[data-metric={name}]").inner_text())
                    assert math.isclose(shown, want[name], rel_tol=1e-3), (step, name, shown)
            assert errors == []
        finally:
            browser.close()
