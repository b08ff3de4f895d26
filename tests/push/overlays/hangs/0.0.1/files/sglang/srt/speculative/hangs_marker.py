"""Marker module of the hangs test overlay."""
