"""Trajectories as text: framework adapters, conversations of turns, chat messages, token2text."""
