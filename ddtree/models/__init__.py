"""Models: the DFlash drafter, the target wrapper, and tiny random models."""
