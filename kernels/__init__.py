"""Triton kernels and the pure-torch reference each one is tested against (``naive.py`` beside it)."""
