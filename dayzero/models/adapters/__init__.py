"""Hugging Face architectures: one short module per family; importing registers them."""
