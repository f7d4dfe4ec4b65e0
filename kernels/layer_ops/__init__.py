"""bf16 layer ops on the CPU (``cpu``) and their plain forms (``naive``)."""
