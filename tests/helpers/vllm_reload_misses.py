"""Three weight updates of the project's RolloutEngine (single process, float32): which layers
vLLM's layerwise reload logs as "Failed to load weights", whether vLLM's LM head is the
embedding's storage and holds the new weights after each update, and how many parameters the
rotary embedding has. Prints one JSON line. Args: FOLDER."""

import json
import logging
import sys

import torch
from transformers import AutoModelForCausalLM

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.rollout import RolloutEngine
from spmd_rl.engines.vllm_logs import RELOAD_LOGGER, RELOAD_MISS, quiet_vllm


class Misses(logging.Handler):
    def __init__(self):
        super().__init__()
        self.layers: list[str] = []

    def emit(self, record):
        if record.msg == RELOAD_MISS:
            self.layers.append(record.args[0])


if __name__ == "__main__":
    folder = sys.argv[1]
    logging.basicConfig(level=logging.WARNING)
    quiet_vllm(None, 0)
    misses = Misses()
    logging.getLogger(RELOAD_LOGGER).addHandler(misses)
    engine = RolloutEngine(folder, detect("cpu"), RolloutConfig(n=1, max_response_length=4), tp=1, dtype="float32",
                           max_model_len=64, seed=0, distributed=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {"head_is_embedding": [], "embedding_is_new": []}
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        weights = [(n, p.detach() + 0.01 * (step + 1) * torch.randn(p.shape, generator=g)) for n, p in hf.named_parameters()]
        engine.update_weights(iter(weights), [(n, t.dtype, list(t.shape)) for n, t in weights])
        vm = engine.model
        emb, head = vm.model.embed_tokens.weight, vm.lm_head.weight
        new = dict(weights)["model.embed_tokens.weight"]
        out["head_is_embedding"].append(head.data_ptr() == emb.data_ptr() and head.shape == emb.shape)
        out["embedding_is_new"].append(bool(torch.equal(emb[: new.shape[0]], new)))
    rotary = [m for m in vm.modules() if type(m).__name__ == "RotaryEmbedding"]
    out["rotary_parameters"] = sum(p.numel() for m in rotary for p in m.parameters()) if rotary else -1
    out["misses"] = sorted(set(misses.layers))
    print(json.dumps(out))
