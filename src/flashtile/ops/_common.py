"""Shared Triton helpers and constants for every kernel file."""

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # ln(x) = log2(x) * LN2
