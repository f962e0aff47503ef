"""Plain PyTorch versions of the algorithms: the oracle (naive), FA1, FA2 and Flash-Decoding."""
