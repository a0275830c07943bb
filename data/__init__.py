"""Stages that make data: the mini world, prepare, capture, vocab (see ARCHITECTURE.md)."""
