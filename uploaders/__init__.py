"""Backends that upload chosen trajectories: MLflow, Weave."""
