"""``linear``: ``y = x · wᵀ + b`` with fp32 accumulation and a chosen output dtype (the fused input projections
of the mixers and the MoE router's fp32 logits)."""
