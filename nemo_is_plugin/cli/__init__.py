"""The ``nemo-is`` command line: one module per command, each exposing ``register(app)``."""
