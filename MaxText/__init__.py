"""A JAX LLM training framework in the spirit of MaxText."""
