"""Optional GPU kernels (Triton) for the hot spots of DDTree; each has an exact torch reference elsewhere."""
