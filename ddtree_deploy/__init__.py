"""ddtree-deploy: snapshot, patch, restart and roll back the installed sglang package on GPU hosts."""

__version__ = "0.1.0"
