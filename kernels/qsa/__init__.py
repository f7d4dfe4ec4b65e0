"""QSA (qwen4_exp indexed attention): ``naive`` holds the per-query sequential reference and the kernels'
references; Triton kernels (import explicitly): ``indexer`` (group scores, exact top-k) and
``sparse_attention`` (attention over each query's own key rows, blockwise prefill)."""
