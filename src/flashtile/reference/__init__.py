"""Plain PyTorch versions of the algorithms: the oracle (naive), FA1, FA2, Flash-Decoding, and
FlexAttention's mods written out densely (flex)."""
