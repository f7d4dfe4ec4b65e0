"""QSA (qwen4_exp indexed attention): ``naive`` holds the per-query sequential reference."""
