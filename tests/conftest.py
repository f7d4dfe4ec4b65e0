"""Test-suite settings. One intra-op thread: on 2-core CI machines torch's default thread pool makes tiny
ops wait for the other core (~100 ms each), which dominates tiny-model tests."""
import os

import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)
