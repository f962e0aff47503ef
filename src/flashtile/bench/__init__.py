"""Benchmarks: `flashtile bench prefill | decode`; results under benchmarks/results/<gpu>/."""
