"""Speculative decoding: drafts are tokens not yet computed, verified in the
same step as everything else."""
