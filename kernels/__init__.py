"""Triton kernels and the pure-torch reference each one is tested against (``naive.py`` beside it); see
kernels/README.md for the interfaces the executors use."""
