"""Marker module of the lossy test overlay."""
