"""Flax (linen) layers of the decoder-only transformer; they speak logical axis names only."""
