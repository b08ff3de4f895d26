"""Measuring speculative decoding on a host's server: the `bench` step's sweep, its results and baselines.

`results` is the JSON schema (pydantic) and the acceptance arithmetic; `measure` turns SGLang's
answers and the overlay's debug lines into those results; `sweep` restarts the server per variant
and measures it; `baseline` reads earlier numbers (z-lab's benchmark.py text, an earlier bench, the
offline decode tool) and compares; `table` and `plots` render a result for the results folder.
"""
