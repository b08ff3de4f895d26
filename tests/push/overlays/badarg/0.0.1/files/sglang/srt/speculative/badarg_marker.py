"""badarg overlay marker (tests only)."""
