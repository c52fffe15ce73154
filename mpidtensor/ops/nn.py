"""Sharding rules: nn (being written)."""
