"""Sharding rules: random (being written)."""
