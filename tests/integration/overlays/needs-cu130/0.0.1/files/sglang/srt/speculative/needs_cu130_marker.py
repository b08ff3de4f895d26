"""Marker module of the needs-cu130 test overlay."""
