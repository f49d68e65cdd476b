"""Held-out evaluation of preference training, in one process through HF forwards (float64
log-softmax): for each (prompt, chosen, rejected) pair of a preference file, the log-ratio of
each response against the reference, D_y = log pi(y|x) - log pi_ref(y|x), and

- ``margin``: mean over pairs of D_c - D_r (DPO's implicit reward margin, over beta); 0 for the
  reference itself;
- ``accuracy``: the fraction of pairs with D_c > D_r (DPO's reward accuracy);
- ``prefers_chosen``: the fraction with log pi(c|x) > log pi(r|x), the policy's own preference
  (``reference_prefers_chosen`` the reference's).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.data.preferences import load_preferences


def sequence_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], batch: int = 64, grad: bool = False
) -> torch.Tensor:
    """[len(prompts)] log pi(response | prompt): the sum of the response tokens' log-probs
    (differentiable with ``grad``)."""
    with torch.set_grad_enabled(grad):
        return _sequence_logprobs(model, prompts, responses, batch)


def _sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], batch: int) -> torch.Tensor:
    out = []
    for s in range(0, len(prompts), batch):
        seqs = [p + r for p, r in zip(prompts[s : s + batch], responses[s : s + batch])]
        width = max(map(len, seqs))
        ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
        mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
        logits = model(input_ids=ids, attention_mask=mask).logits
        for k, (p, r) in enumerate(zip(prompts[s : s + batch], responses[s : s + batch])):
            # float64 only at this response's positions: log_softmax(x)_y = x_y - logsumexp(x). A
            # float64 log-softmax of the whole [batch, T, V] was about 40 GB at a 152k vocabulary
            rows = logits[k, len(p) - 1 : len(p) + len(r) - 1].double()
            out.append((rows.gather(-1, torch.tensor(r)[:, None]).squeeze(-1) - rows.logsumexp(-1)).sum())
    return torch.stack(out)


def preference_eval(
    model_dir: str | Path,
    reference_dir: str | Path,
    data: str | Path,
    limit: int | None = None,
    max_prompt_length: int = 10**6,
    max_response_length: int = 10**6,
) -> dict:
    """The module docstring's metrics of ``model_dir`` against ``reference_dir`` on ``data``
    (columns prompt, chosen, rejected; chat template on)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = load_preferences(data, tok, "prompt", "chosen", "rejected", max_prompt_length, max_response_length)
    prompts, chosen, rejected = (
        pairs.prompt_ids[:limit],
        [c for c, _ in pairs.pairs[:limit]],
        [r for _, r in pairs.pairs[:limit]],
    )
    scores = {}
    for name, folder in (("policy", model_dir), ("reference", reference_dir)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        scores[name] = (sequence_logprobs(model, prompts, chosen), sequence_logprobs(model, prompts, rejected))
    (pc, pr), (rc, rr) = scores["policy"], scores["reference"]
    d = (pc - rc) - (pr - rr)
    return {
        "model": str(model_dir),
        "reference": str(reference_dir),
        "data": str(data),
        "pairs": len(prompts),
        "margin": float(d.mean()),
        "accuracy": float((d > 0).double().mean()),
        "prefers_chosen": float((pc > pr).double().mean()),
        "reference_prefers_chosen": float((rc > rr).double().mean()),
    }
