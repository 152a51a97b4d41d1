"""Comparing trajectories: where two conversations part ways, and an HTML report of it."""
