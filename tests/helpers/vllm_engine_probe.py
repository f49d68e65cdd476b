"""The project's VllmRollout (single process, float32) started as a colocated engine starts:
from dummy weights. Records whether it refuses to generate before its first weight load,
whether building it left the process's float32 matmul precision alone, then over three weight
updates: which layers vLLM's layerwise reload logs as "Failed to load weights", whether vLLM's
LM head is the embedding's storage and holds the new weights, and whether greedy generation
equals HF's on the same perturbed weights; how many parameters the rotary embedding has; and how
many frames torch.compile compiled while it generated (``rollout.vllm.enforce_eager``: none); the
bytes of KV cache it allocated for a budget of a sixteenth of a GiB; and, as the process ends
through ``teardown.exit_after`` as a rank's does, whether vLLM's engine-core finalizer was found
and detached (the exit frees what its shutdown would).
Prints one JSON line. Args: FOLDER."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import logging
import sys

import torch
import vllm
from transformers import AutoModelForCausalLM

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.vllm import compat
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.vllm.logs import RELOAD_LOGGER, RELOAD_MISS, quiet_vllm


KV_GIB = 0.0625
"""A fraction of a GiB: vLLM's legacy CPU variable would have made it 1 GiB."""


class Misses(logging.Handler):
    def __init__(self):
        super().__init__()
        self.layers: list[str] = []

    def emit(self, record):
        if record.msg == RELOAD_MISS:
            self.layers.append(record.args[0])


def main() -> None:
    folder = sys.argv[1]
    logging.basicConfig(level=logging.WARNING)
    quiet_vllm(None, 0)
    misses = Misses()
    logging.getLogger(RELOAD_LOGGER).addHandler(misses)
    torch.set_float32_matmul_precision("medium")  # vLLM's worker sets "highest" process-wide
    engine = VllmRollout.build(
        folder,
        detect("cpu"),
        RolloutConfig(n=1, max_response_length=4, kv_cache_gib=KV_GIB),
        tp=1,
        dtype="float32",
        max_model_len=64,
        seed=0,
        distributed=False,
        dummy_weights=True,
    )
    out = {
        "precision_after_build": torch.get_float32_matmul_precision(),
        "head_is_embedding": [],
        "embedding_is_new": [],
        "greedy_equals_hf": [],
        "kv_cache_bytes": engine.kv_cache_bytes(),
        "kv_cache_budget": int(KV_GIB * 2**30),
    }
    finalizer = compat.core_finalizer(engine.llm)
    out["core_finalizer_detached"] = None if finalizer is None else not finalizer.alive
    out["vllm"] = vllm.__version__
    measure(engine, folder, out)
    out["misses"] = sorted(set(misses.layers))
    print(json.dumps(out))


def measure(engine: VllmRollout, folder: str, out: dict) -> None:
    prompt = [3, 17, 42, 5, 9]
    try:
        engine.generate([prompt], n=1, max_tokens=4, temperature=0.0)
        out["refused_before_load"] = False
    except RuntimeError as exc:
        out["refused_before_load"] = "update_weights" in str(exc)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        weights = [
            (n, p.detach() + 0.01 * (step + 1) * torch.randn(p.shape, generator=g)) for n, p in hf.named_parameters()
        ]
        engine.update_weights(iter(weights), [(n, t.dtype, list(t.shape)) for n, t in weights])
        vm = engine.model
        emb, head = vm.model.embed_tokens.weight, vm.lm_head.weight
        new = dict(weights)["model.embed_tokens.weight"]
        out["head_is_embedding"].append(head.data_ptr() == emb.data_ptr() and head.shape == emb.shape)
        out["embedding_is_new"].append(bool(torch.equal(emb[: new.shape[0]], new)))
        moved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        moved.load_state_dict(dict(weights), strict=False)
        ref = moved.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
        got = engine.generate([prompt], n=1, max_tokens=4, temperature=0.0)[0].token_ids
        out["greedy_equals_hf"].append(got == ref[: len(got)] and len(got) > 0)
    engine.generate([prompt], n=4, max_tokens=4, temperature=1.0, seed=1)  # the random sampler too
    from torch._dynamo.utils import counters

    out["compiled_frames"] = sum(counters["frames"].values())  # rollout.vllm.enforce_eager: vLLM's sampler ran eagerly
    rotary = [m for m in vm.modules() if type(m).__name__ == "RotaryEmbedding"]
    out["rotary_parameters"] = sum(p.numel() for m in rotary for p in m.parameters()) if rotary else -1


if __name__ == "__main__":
    exit_after(main)
