"""Marker module of the needs-py313 test overlay."""
