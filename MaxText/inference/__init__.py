"""Decoding: the KV cache, sampling and the compiled generate loop (decoding.py, sampling.py)."""
