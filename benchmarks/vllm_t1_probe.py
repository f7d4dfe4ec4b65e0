"""What vLLM's rejection sampler is handed at T > 0 (run with the vLLM venv's python).

    /work/vllm-venv/bin/python benchmarks/vllm_t1_probe.py judge --model TARGET --drafter EXPORT \
        --input REQS.jsonl --output OUT.json --dtype float32 --max-model-len 256 --num-speculative-tokens 4 \
        --draft-sample-method probabilistic [--max-num-seqs 1] [--patch-cpu-expand]

Runs ``specopd/engines/vllm_runner.py``'s judge with the engine in this process and three hooks: the model
runner's ``propose_draft_token_ids`` (the drafts and draft probs per request id), its ``_sample`` (the target's
logits of the verified positions, as the model computed them, and the per-request temperature) and
``rejection_sampler._rejection_random_sample`` (the draft ids, draft probs, target probs and uniforms the
ratio-test kernel gets, and what it outputs). Prints whether the kernel got the proposer's drafts and draft probs,
whether its output is its own ratio test on its inputs, and per draft position: reached,
accepted, the acceptance exact rejection sampling gives on these drafts (E min(1, p(d) / q(d)) with p the
model's softmax(logits / T)), and how many target-prob rows the kernel got differ from that p (NaN / one-hot /
uniform / other). Nothing in the vLLM venv is edited.
"""
from __future__ import annotations

import importlib.util
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks live in this process

import torch  # noqa: E402

import vllm.v1.sample.rejection_sampler as rejection_sampler  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specopd", "engines",
                      "vllm_runner.py")
# held at module level: vLLM's worker swaps the C++ stand-in into every module-level holder of this launcher
KERNEL = rejection_sampler._rejection_random_sample
STEPS: list = []  # one dict per verification step: logits, temp (from _sample), kernel (from the kernel hook)
PROPOSED: dict = {}  # request id -> (drafts [k], draft probs [k, V] or None) of the latest proposal


def _hook_sample(orig):
    def sample(self, logits, meta):
        if meta is not None:
            temp = self.input_batch.sampling_metadata.temperature
            STEPS.append(dict(logits=logits[meta.target_logits_indices].float().clone(),
                              temp=None if temp is None else temp.clone(), num_draft=list(meta.num_draft_tokens),
                              proposed=[PROPOSED.get(r) for r in self.input_batch.req_ids]))
        return orig(self, logits, meta)
    return sample


def _hook_propose(orig):
    def propose(self, *args, **kwargs):
        drafts = orig(self, *args, **kwargs)
        d = drafts if isinstance(drafts, torch.Tensor) else torch.tensor(drafts)
        probs = self._draft_probs
        for row, rid in enumerate(self.input_batch.req_ids):
            PROPOSED[rid] = (d[row].clone().long(), None if probs is None else probs[row].clone())
        return drafts
    return propose


def _hook_kernel(orig):
    def kernel(out, cu, draft_ids, draft_probs, target_probs, bonus, recovered, uniform, is_greedy, msl, syn):
        res = orig(out, cu, draft_ids, draft_probs, target_probs, bonus, recovered, uniform, is_greedy, msl, syn)
        if STEPS:
            STEPS[-1]["kernel"] = dict(cu=cu.clone(), d=draft_ids.clone().long(), q=None if draft_probs is None
                                       else draft_probs.clone(), p=target_probs.clone(), u=uniform.clone(),
                                       out=out.clone())
        return res
    kernel.register_warmup = orig.register_warmup
    return kernel


def _row_kind(p_kernel: torch.Tensor, p_true: torch.Tensor) -> str:
    if torch.allclose(p_kernel, p_true, atol=1e-5):
        return "right"
    if p_kernel.isnan().any():
        return "nan"
    if (p_kernel > 0.999).any():
        return "one-hot"
    if (p_kernel - 1.0 / p_kernel.numel()).abs().max() < 1e-6:
        return "uniform"
    return "other"


def report() -> None:
    k = max((max(s["num_draft"]) for s in STEPS if "kernel" in s), default=0)
    reached, accepted, exact = [0] * k, [0] * k, [0.0] * k
    kinds: dict = {}
    kernel_consistent = kernel_total = same_drafts = same_probs = 0
    for s in STEPS:
        kr = s.get("kernel")
        if kr is None:
            continue
        t = s["temp"] if s["temp"] is not None else torch.ones(len(s["num_draft"]))
        off = 0
        for i, n in enumerate(s["num_draft"]):
            a, off = off, off + n
            rows = slice(a, off)
            if n == 0:
                continue
            d = kr["d"][rows]
            q = kr["q"][rows] if kr["q"] is not None else None
            prop = s["proposed"][i]  # what the proposer drafted for this request, matched by id
            same_drafts += prop is not None and torch.equal(prop[0][:n], d)
            same_probs += prop is not None and (q is None or (prop[1] is not None and torch.equal(prop[1][:n], q)))
            p_true = torch.softmax(s["logits"][rows] / float(t[i]), -1)
            got = int((kr["out"][i] >= 0).sum()) - 1  # accepted = tokens written - 1 (a recovered or bonus one)
            # the kernel's own ratio test on its own inputs (it is right given them)
            ratio = [(kr["p"][a + j, d[j]] / (q[j, d[j]] if q is not None else 1.0)).item() for j in range(n)]
            pred = 0
            while pred < n and ratio[pred] >= kr["u"][a + pred].item():
                pred += 1
            kernel_consistent += pred == got
            kernel_total += 1
            for j in range(min(n, got + 1)):
                reached[j] += 1
                accepted[j] += j < got
                qd = q[j, d[j]].item() if q is not None else 1.0
                exact[j] += min(1.0, p_true[j, d[j]].item() / qd) if qd > 0 else 0.0
                kind = _row_kind(kr["p"][a + j], p_true[j])
                kinds[kind] = kinds.get(kind, 0) + 1
    print(f"[probe] drafts verified {kernel_total}; kernel output = its own ratio test on its inputs: "
          f"{kernel_consistent}/{kernel_total}")
    print(f"[probe] drafts / draft probs the kernel got = the proposer's for that request: {same_drafts} / "
          f"{same_probs} of {kernel_total}")
    print(f"[probe] target-prob rows the kernel got vs the model's softmax(logits / T): {kinds}")
    for j in range(k):
        if reached[j]:
            print(f"[probe] position {j + 1}: accepted {accepted[j]}/{reached[j]} = {accepted[j] / reached[j]:.3f}; "
                  f"exact rejection sampling on these drafts {exact[j] / reached[j]:.3f}")


def main(argv) -> int:
    spec = importlib.util.spec_from_file_location("vllm_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    GPUModelRunner._sample = _hook_sample(GPUModelRunner._sample)
    GPUModelRunner.propose_draft_token_ids = _hook_propose(GPUModelRunner.propose_draft_token_ids)
    rejection_sampler._rejection_random_sample = _hook_kernel(KERNEL)
    rc = runner.main(argv)
    report()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
