"""``linear``: ``y = x · wᵀ + b (+ add)`` with fp32 accumulation and a chosen output dtype (the mixers' projections,
the MoE router's fp32 logits, the LatentMoE up-projection with the shared expert added); ``rms_norm_linear``: a
layer's input RMSNorm and its first (fused) projection, one launch on a decode step's few rows; ``act_linear``: an
MLP's activation and its down projection, and ``rms_norm_gated_linear``: KDA's gated output norm and its output
projection, likewise."""
