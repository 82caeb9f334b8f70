"""Host adapters: NeMo-RL (``nemo_rl.py``, the LossFunction protocol) and verl (``verl.py``, verl's policy-loss
registry). Each imports only its own host, lazily; importing this package imports neither."""
