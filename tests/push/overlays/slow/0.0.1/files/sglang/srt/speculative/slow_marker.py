"""Marker module of the `slow` test overlay: nothing imports it."""
