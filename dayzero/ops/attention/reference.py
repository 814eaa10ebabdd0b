"""Reference implementation (pure PyTorch, fp32 accumulation)."""
