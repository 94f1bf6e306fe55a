"""Drafter training: prompts from installed text, the target's own responses, DFlash block-wise training."""
