"""Conversion between Hugging Face checkpoints and elastic_jax parameters."""
