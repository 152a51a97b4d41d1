"""Reading a run: open it, list and pick trajectories, load their spans, query them with SQL."""
