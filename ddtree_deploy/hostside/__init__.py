"""The host helper: stdlib-only modules shipped to the host's own python with every call.

`bootstrap.py` is passed as `python -c`; it reads `{"modules": {name: source}, "request": ...}`
from stdin, imports these modules from memory as the package `ddtree_hostside`, and prints one JSON
answer. Ops are declared by each module's `OPS` table and dispatched by `main.run`.
Nothing in this package may import outside the standard library.
"""
