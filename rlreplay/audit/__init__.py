"""Finding what is wrong in a run: checks over its listing and its trajectories (``rlreplay audit``).

A check is a :class:`~rlreplay.hookspecs.Check` registered in the entry-point group
``rlreplay.checks`` (rlreplay's own are too), so a team adds its own in a package.
"""
