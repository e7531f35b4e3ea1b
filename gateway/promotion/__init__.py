"""Promotion of trained steps: offline eval sets and the graders that score their answers."""
