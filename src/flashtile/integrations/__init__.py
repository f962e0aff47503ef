"""flashtile inside other libraries. Each integration is its own module and imports its library only
when used, so `import flashtile` never needs them; none of them imports triton.

    transformers    attn_implementation="flashtile" for Hugging Face models (register() first)
"""
