"""Sharding rules: indexing (being written)."""
