"""Sample from a model folder through the project's VllmRollout (single process) and print
one JSON line: the prompt ids, and per sample the token ids and the rollout log-probs
(run as a subprocess: vLLM changes process state). Args: FOLDER TEMPERATURE [published]
[top_p=P] [top_k=K] [n=N].

``published``: the engine runs in its own process (as on a generator of the separated
placement) and samples after ``update_weights`` loaded ``perturbed(FOLDER)``, streamed
through the weight file as the weight broadcast delivers it."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import sys

import torch

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.vllm.engine import VllmRollout

PROMPT = "36+31="


def perturbed(folder: str) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters (HF names, tied ones once) plus seeded noise of 0.05 std."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return [(n, p.detach() + 0.02 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


if __name__ == "__main__":
    folder, temperature, published = sys.argv[1], float(sys.argv[2]), "published" in sys.argv[3:]
    opts = dict(a.split("=") for a in sys.argv[3:] if "=" in a)
    n = int(opts.get("n", 4))
    cfg = RolloutConfig(
        n=n,
        max_response_length=8,
        temperature=temperature,
        top_p=float(opts.get("top_p", 1.0)),
        top_k=int(opts.get("top_k", -1)),
    )
    engine = VllmRollout.build(
        folder,
        detect("cpu"),
        cfg,
        tp=1,
        dtype="float32",
        max_model_len=64,
        seed=0,
        distributed=False,
        own_process=published,
    )
    if published:
        weights = perturbed(folder)
        engine.update_weights(iter(weights), [(n, t.dtype, list(t.shape)) for n, t in weights])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    samples = engine.generate([prompt], n=n, max_tokens=8, seed=1)
    print(json.dumps({"prompt": prompt, "samples": [{"ids": s.token_ids, "logprobs": s.logprobs} for s in samples]}))
