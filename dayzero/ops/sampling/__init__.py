"""``greedy_sample``: a decode step's greedy tokens and their log-probabilities from the logits in one pass."""
