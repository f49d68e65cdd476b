"""torchrun worker: training engine (FSDP2/TP) -> allgather-swap -> in-process vLLM, checked
against HF (greedy output, log-probs), bit-exact swap round trips and the memory ledger; for the
dense tiny model and its MoE sibling (fused experts in the trainer, one by one in the sync).

Env: TRAIN_DP, TRAIN_TP, GEN_TP, MODEL, SPMD_RL_OUT. Writes rank<k>.json with the findings.
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.config.layout import Layout, Layouts
from spmd_rl.config.schema import ActorConfig, ReshardConfig, RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import train_mesh
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.training.logprobs import build_batch
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.training.logprobs import split
from spmd_rl.engines.fsdp.engine import TrainEngine
from spmd_rl.engines.base import local
from spmd_rl.reshard.allgather_swap import Resharder

MODEL = os.environ["MODEL"]
QUESTIONS = ["12+7=", "45+45=", "3+98=", "60+1="]


def full_state(engine):
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for n, p in engine.model.named_parameters()
    }


def local_state(engine):
    return [local(p).detach().clone() for p in engine.model.parameters()] + [
        t.clone() for t in engine.optimizer_tensors()
    ]


def train_once(engine, batch):
    def loss_fn(lp, ent, k):
        return -(lp.sum() / batch.mask.sum())

    return engine.train_step(split(batch, 4), loss_fn)


def main():  # noqa: PLR0915
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    acc = detect("cpu")
    lay = Layouts(
        world,
        world,
        Layout(int(os.environ["TRAIN_DP"]), int(os.environ["TRAIN_TP"])),
        Layout(world // int(os.environ["GEN_TP"]), int(os.environ["GEN_TP"])),
    )
    mesh = train_mesh(acc, lay.train)
    tok = AutoTokenizer.from_pretrained(MODEL)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    actor_cfg = ActorConfig(mini_batch_size=1, micro_batch_size=4, optim={"lr": 1e-3, "grad_clip": 1.0})
    engine = TrainEngine(MODEL, acc, mesh, actor_cfg, "float32", total_steps=10)
    twin = TrainEngine(MODEL, acc, mesh, actor_cfg, "float32", total_steps=10)  # same steps, never swapped
    rollout = VllmRollout.build(
        MODEL, acc, RolloutConfig(n=1, max_response_length=6), tp=lay.gen.tp, dtype="float32", max_model_len=64
    )
    resharder = Resharder(engine, rollout, ReshardConfig(mode="allgather_swap", bucket_bytes=64 << 10), "float32")
    naive = Resharder(engine, rollout, ReshardConfig(mode="naive"), "float32")
    my_prompts = prompts  # every generation DP group runs all prompts, so TP peers of the training layout share inputs
    fixed = build_batch(
        [torch.tensor(p) for p in prompts], [torch.tensor([19, 20, 2]) for _ in prompts], tok.pad_token_id
    )

    report = {
        "rank": rank,
        "greedy_equal": [],
        "max_logprob_diff": [],
        "swap_bit_exact": [],
        "resident_params_during_gen": [],
    }
    for it in range(4):
        if it > 0:  # three weight updates, each followed by a reshard
            train_once(engine, fixed)
            train_once(twin, fixed)
        before = local_state(engine)
        resharder.to_generation()
        report["resident_params_during_gen"].append(resharder.ledger.rows[-1][1]["actor_params"])
        samples = rollout.generate(my_prompts, n=1, max_tokens=6, temperature=0.0)
        resharder.to_training()
        after = local_state(engine)
        report["swap_bit_exact"].append(
            all(
                torch.equal(
                    a.view(torch.uint8) if a.dtype != torch.bool else a,
                    b.view(torch.uint8) if b.dtype != torch.bool else b,
                )
                for a, b in zip(before, after)
            )
        )
        weights = full_state(engine)
        hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        hf.load_state_dict(weights, strict=False)
        hf.tie_weights()
        greedy = [
            hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[
                0, len(p) :
            ].tolist()
            for p in my_prompts
        ]
        report["greedy_equal"].append(all(g[: len(s.token_ids)] == s.token_ids for g, s in zip(greedy, samples)))
        seqs = build_batch(
            [torch.tensor(p) for p in my_prompts], [torch.tensor(s.token_ids) for s in samples], tok.pad_token_id
        )
        lp, _ = engine.infer(split(seqs, 8))
        diffs = [abs(lp[k, j].item() - s.logprobs[j]) for k, s in enumerate(samples) for j in range(len(s.token_ids))]
        report["max_logprob_diff"].append(max(diffs))
        # vLLM weights that vLLM CPU does not repack, against this rank's TP slice: bit for bit
        vparams = dict(rollout.model.named_parameters())
        tp_rank, tp = lay.gen.coords(rank)[1], lay.gen.tp
        norm_ok = torch.equal(vparams["model.norm.weight"], weights["model.norm.weight"])
        sl = lambda t: t.chunk(tp)[tp_rank]  # noqa: E731
        if "model.layers.0.self_attn.q_proj.bias" in weights:  # Qwen2: the fused qkv bias, this rank's slice
            q, k, v = (weights[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
            bias_ok = torch.equal(vparams["model.layers.0.self_attn.qkv_proj.bias"], torch.cat([sl(q), sl(k), sl(v)]))
        else:  # Qwen3-MoE: the per-head q and k norms, replicated over TP (vLLM CPU packs the router and experts)
            bias_ok = all(
                torch.equal(vparams[n], weights[n])
                for n in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight")
            )
        emb = vparams["model.embed_tokens.weight"]
        rows = emb.shape[0]
        start = tp_rank * rows
        full_emb = weights["model.embed_tokens.weight"][start : start + rows]
        emb_ok = torch.equal(emb[: full_emb.shape[0]], full_emb)
        report.setdefault("vllm_weights_bit_exact", []).append(bool(norm_ok and bias_ok and emb_ok))

    final, twin_final = full_state(engine), full_state(twin)
    report["swapped_equals_unswapped"] = all(torch.equal(final[n], twin_final[n]) for n in final)
    # ledger: naive keeps the training state resident during generation
    naive.to_generation()
    naive_gen = naive.ledger.total("generate")
    resharder.to_generation()
    swap_gen = resharder.ledger.total("generate")
    resharder.to_training()
    row = naive.ledger.rows[-1][1]
    report["ledger_saving"] = naive_gen - swap_gen
    report["ledger_kv_cache"] = resharder.ledger.rows[-2][1]["kv_cache"]  # the "generate" row
    report["ledger_train_state"] = row["actor_params"] + row["actor_grads"] + row["actor_optim"]
    report["temp_peak_swap"] = resharder.temp_peak
    report["temp_peak_naive"] = naive.temp_peak
    report["largest_param_bytes"] = max(p.numel() * 4 for p in engine.model.parameters())
    report["model_bytes"] = sum(w.numel() * 4 for w in final.values())
    Path(os.environ["SPMD_RL_OUT"], f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        print(resharder.ledger.table(), flush=True)


if __name__ == "__main__":
    exit_after(main)
