"""Triton kernels, one file per algorithm, each with its launcher."""
