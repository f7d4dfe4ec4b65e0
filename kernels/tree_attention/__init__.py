"""Tree attention for scoring proposal trees: ``naive`` (dense masked reference), ``plan`` (the block plan and
the blocked torch path that uses it), ``triton_fwd`` (the Triton forward kernel; import it explicitly) and ``cpu``
(bf16 in C on CPUs with AVX512-BF16; import it explicitly)."""
from specopd_kernels.tree_attention.naive import tree_attention_reference  # noqa: F401
from specopd_kernels.tree_attention.plan import (  # noqa: F401
    TreeAttentionPlan, block_groups, build_tree_plan, tree_attention_blocked)
