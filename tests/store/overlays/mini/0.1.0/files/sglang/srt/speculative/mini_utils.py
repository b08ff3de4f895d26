"""mini overlay 0.1.0: a whole new module (test fixture for ddtree-deploy's store tests)."""

MINI_VERSION = "0.1.0"
