"""Block sizes, autotune lists and heuristics for every kernel: no literals elsewhere.

Plain functions, so a user can override a choice by replacing the function.
"""
