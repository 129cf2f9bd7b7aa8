"""Bridges to other systems (Ray)."""
