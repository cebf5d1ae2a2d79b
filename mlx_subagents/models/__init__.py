"""Local models: the catalog of what this machine can run, and GGUF import."""
