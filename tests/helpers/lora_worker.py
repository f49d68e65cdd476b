"""torchrun worker: a LoRA actor (FSDP2 over DP 2) checked against independent references.

- before any update: the adapted trainer == the base model (HF forward), B = 0;
- after three updates: adapters off == the HF base model; adapters on == an HF model loaded
  with the merged weights; the base weights are bit-identical to the file; the optimizer holds
  two states per adapter element and nothing else;
- the sync (``LORA_SYNC``): ``merged`` sends W + (alpha/r) B A through allgather-swap;
  ``adapter`` loads the base once and then only the adapters into vLLM's LoRA. Either way vLLM
  returns the trainer's log-probs at its sampled tokens after each of two syncs;
- save / load: the checkpoint holds the adapters only, and a fresh engine loading it computes
  the same log-probs.

Env: MODEL, SPMD_RL_OUT, LORA_SYNC. Writes rank<k>.json.
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import ActorConfig, LoRAConfig, ReshardConfig, RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import train_mesh
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.training import lora
from spmd_rl.engines.base import local
from spmd_rl.engines.training.hf_weights import SafetensorsFolder
from spmd_rl.engines.training.logprobs import build_batch, split
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.fsdp.engine import TrainEngine
from spmd_rl.reshard.allgather_swap import Resharder

MODEL = os.environ["MODEL"]
QUESTIONS = ["12+7=", "45+45=", "3+98=", "60+1="]


def hf_logprobs(weights: dict | None, seqs) -> torch.Tensor:
    """Response log-probs of the HF model (its folder, or ``weights`` loaded into it)."""
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    if weights is not None:
        hf.load_state_dict(weights, strict=False)
        hf.tie_weights()
    logits = hf(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs.input_ids[:, 1:, None])[..., 0]
    R = seqs.mask.shape[1]
    out = torch.zeros_like(seqs.mask, dtype=torch.float32)
    for b in range(len(seqs.mask)):
        p = int(seqs.attention_mask[b].sum()) - int(seqs.mask[b].sum())
        n = int(seqs.mask[b].sum())
        out[b, :n] = lp[b, p - 1 : p - 1 + n]
    return out[:, :R]


def main():  # noqa: PLR0915
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    acc = detect("cpu")
    mesh = train_mesh(acc, Layout(2, 1))
    tok = AutoTokenizer.from_pretrained(MODEL)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    cfg = ActorConfig(
        mini_batch_size=1,
        micro_batch_size=4,
        optim={"lr": 2e-2, "grad_clip": 1.0},
        pack_sequences=False,
        lora=LoRAConfig(
            rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], sync=os.environ["LORA_SYNC"]
        ),
    )
    engine = TrainEngine(MODEL, acc, mesh, cfg, "float32", total_steps=10, seed=3)
    fixed = build_batch(
        [torch.tensor(p) for p in prompts], [torch.tensor([19, 20, 2]) for _ in prompts], tok.pad_token_id
    )
    report: dict = {"rank": rank}
    lp0, _ = engine.infer(split(fixed, 4))
    base = hf_logprobs(None, fixed)
    report["initial_vs_base"] = float((lp0 - base).abs().max())
    for _ in range(3):
        engine.train_step(split(fixed, 2), lambda lp, ent, k: -(lp.sum() / fixed.mask.sum()))
    lp, _ = engine.infer(split(fixed, 4))
    ref, _ = engine.reference().infer(split(fixed, 4))
    report["adapted_moved"] = float((lp - base).abs().max())
    report["reference_vs_base"] = float((ref - base).abs().max())
    # no second copy: the reference reads the actor's own base tensors, so doubling one of them
    # in place moves the reference's log-probs (then halved back, bit for bit)
    norm = dict(engine.model.named_parameters())["model.norm.weight"]
    with torch.no_grad():
        local(norm).mul_(2.0)
        moved, _ = engine.reference().infer(split(fixed, 4))
        local(norm).div_(2.0)
    report["reference_reads_actor_tensors"] = float((moved - ref).abs().max())
    _, stream = engine.full_weights(torch.float32, 1 << 20)
    synced = {n: t.clone() for n, t in stream}
    report["synced_names_are_checkpoint_names"] = sorted(synced) == sorted(SafetensorsFolder(MODEL).index)
    merged = (
        synced
        if cfg.lora.sync == "merged"
        else {n: t + lora.merge_deltas(engine.model).get(n, torch.zeros(())) for n, t in synced.items()}
    )
    report["merged_vs_adapted"] = float((hf_logprobs(merged, fixed) - lp).abs().max())
    report["synced_is_base"] = all(torch.equal(t, SafetensorsFolder(MODEL).read(n)) for n, t in synced.items())
    files = SafetensorsFolder(MODEL)
    report["base_frozen_bit_exact"] = all(
        torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, files.read(n))
        for n, p in engine.model.named_parameters()
        if not lora.is_adapter(n)
    )
    adapters = [p for n, p in engine.model.named_parameters() if lora.is_adapter(n)]
    report["adapter_local_numel"] = sum(local(p).numel() for p in adapters)
    report["optimizer_local_numel"] = sum(t.numel() for t in engine.optimizer_tensors())
    report["adapter_full_numel"] = sum(p.numel() for p in adapters)
    report["adapted_layers"] = len(list(lora.lora_modules(engine.model)))
    report["decoder_layers"] = engine.model.config.num_hidden_layers
    # the sync, twice: vLLM samples from the trainer's policy after each
    rollout = VllmRollout.build(
        MODEL,
        acc,
        RolloutConfig(n=1, max_response_length=6),
        tp=2,
        dtype="float32",
        max_model_len=64,
        dummy_weights=True,
        lora=cfg.lora if cfg.lora.sync == "adapter" else None,
    )
    loads = []
    full_load = rollout.update_weights
    rollout.update_weights = lambda *a, **k: (loads.append(1), full_load(*a, **k))[1]
    resharder = Resharder(engine, rollout, ReshardConfig(mode="allgather_swap", bucket_bytes=64 << 10), "float32")
    report["vllm_vs_trainer"], report["sync_s"] = [], []
    for round_ in range(2):
        if round_:
            engine.train_step(split(fixed, 2), lambda lp, ent, k: -(lp.sum() / fixed.mask.sum()))
        t0 = time.perf_counter()
        resharder.to_generation()
        samples = rollout.generate(prompts, n=1, max_tokens=6, temperature=1.0, seed=7 + round_)
        report["sync_s"].append(time.perf_counter() - t0)
        resharder.to_training()
        seqs = build_batch(
            [torch.tensor(p) for p in prompts], [torch.tensor(s.token_ids) for s in samples], tok.pad_token_id
        )
        got, _ = engine.infer(split(seqs, 4))
        report["vllm_vs_trainer"].append(
            max(abs(got[k, j].item() - s.logprobs[j]) for k, s in enumerate(samples) for j in range(len(s.token_ids)))
        )
    report["full_weight_loads"] = len(loads)
    report["adapter_versions"] = rollout.adapters.version if rollout.adapters else 0
    # checkpoint: adapters and their optimizer state only; a fresh engine resumes them
    lp, _ = engine.infer(split(fixed, 4))  # after the fourth update
    folder = Path(os.environ["SPMD_RL_OUT"], "ckpt")
    engine.save(folder)
    state = engine.state_dict()
    report["saved_model_keys_are_adapters"] = bool(state["model"]) and all(lora.is_adapter(k) for k in state["model"])
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
    fresh = TrainEngine(MODEL, acc, mesh, cfg, "float32", total_steps=10, seed=99)
    fresh.load(folder)
    again, _ = fresh.infer(split(fixed, 4))
    report["resumed_vs_saved"] = float((again - lp).abs().max())
    Path(os.environ["SPMD_RL_OUT"], f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    exit_after(main)
