"""Optional GPU kernels (Triton) for the hot spots of DDTree; each has an exact torch reference elsewhere."""

ATTENTION_CHOICES = ("auto", "sdpa", "triton")  # the target's attention (`tree_attention.resolve_attention`)
