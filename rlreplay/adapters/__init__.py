"""Framework adapters: what rlreplay knows about one RL framework, and which adapter reads a run.

``generic`` is the base every adapter subclasses (``rlreplay.hookspecs.FrameworkAdapter`` is the
interface); ``registry`` finds the installed adapters and the one a run's ``run.json`` names.
"""
