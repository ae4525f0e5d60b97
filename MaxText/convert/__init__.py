"""Checkpoint conversion between Hugging Face and MaxText (convert_hf_checkpoint.py, convert_to_hf_checkpoint.py)."""
