"""Trajectories as text: conversations of turns, chat messages, token2text."""
