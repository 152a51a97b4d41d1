"""The training–inference mismatch microscope: the trainer's and the rollout's log-probs compared
token by token, over model tokens only.

- ``rlreplay.mismatch.tokens`` reads each response's tokens with both sides' log-probs (a whole
  step at a time, or one loaded trajectory) and defines which tokens count.
- ``rlreplay.mismatch.metrics`` defines every number (verl 0.9.1's off-policy metrics, the
  per-token gap, importance-ratio bounds, verdicts, trends, buckets).
- ``rlreplay.mismatch.report`` puts them together for a selection of a run: what
  ``rlreplay mismatch``, the audit's ``mismatch`` check and the UI's mismatch page show.
"""

#: What a report can be bucketed by (``--by``): per step and split, then per response or per token.
BY = (
    "step",
    "worker",
    "position",
    "probability",
    "entropy",
    "turn",
    "token",
    "rollout",
    "version",
    "staleness",
)
