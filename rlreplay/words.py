"""Counts said in words, their nouns agreeing with them."""

from __future__ import annotations


def plural(count: int | str, noun: str, nouns: str | None = None) -> str:
    """``count`` and the noun that agrees with it: "1 tool call", "2 tool calls", "1–4 prompts"."""
    return f"{count} {noun if str(count) == '1' else nouns or noun + 's'}"


def trajectories(count: int) -> str:
    """``count`` trajectories, "1 trajectory" for one."""
    return plural(count, "trajectory", "trajectories")
