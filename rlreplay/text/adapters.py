"""``turns``, where the README of earlier releases imported it from (``rlreplay.text.conversation`` now).

The framework adapters themselves live in ``rlreplay.adapters``.
"""

from __future__ import annotations

from rlreplay.text.conversation import turns

__all__ = ["turns"]
