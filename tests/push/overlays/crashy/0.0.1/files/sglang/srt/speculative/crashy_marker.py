"""Marker module of the crashy test overlay."""
