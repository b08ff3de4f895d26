"""The host helper: stdlib-only modules shipped to the host's own python with every call.

`bootstrap.py` is passed as `python -c`; it reads one line `{"modules": {name: source}}` from
stdin, imports these modules from memory as the package `ddtree_hostside`, then answers one JSON
line per JSON request line until stdin closes (`main.serve`): one helper process per host per
command, one round trip per operation. Ops are declared by each module's `OPS` table.
Nothing in this package may import outside the standard library.
"""
