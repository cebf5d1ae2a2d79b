"""The mlx room: `MlxModelHost` and the one thread that runs every mlx call (`mlx_thread.py`), the
scheduler that moves each turn through its stages (admission, prefill, decode, outbox), the
single-sequence path, the grammar masks of a batch, loading a model and the machine's resident models."""
