"""Low-precision weight formats: MXFP4 (OCP microscaling), block-scaled FP8, and the expert workspace."""
