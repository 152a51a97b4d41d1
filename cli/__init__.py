"""Command-line interface: a thin face over the rlreplay library."""
