"""Typed dataclass schemas for every stage's config (one module per stage)."""
