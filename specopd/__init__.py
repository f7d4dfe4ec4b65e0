"""SpecOPD: on-policy training of speculative-decoding drafters without sequential rollouts."""
__version__ = "0.1.0"
