"""Recorders that hook rlreplay into training frameworks (verl)."""
