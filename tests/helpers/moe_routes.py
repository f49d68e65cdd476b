"""Routing replay against vLLM on the tiny Qwen3-MoE (one process: vLLM, then HF). Samples with
routes recorded (``VllmRollout.build(record_routes=True)``), then scores the samples with an HF
float32 forward three ways: the model's own routing, the project's replay
(``engines.training.route_replay``, padded and packed layouts), and an independent replay written here
(each MoE block recomputed from the recorded experts). Prints one JSON line.
Args: FOLDER DTYPE [near-tie] (near-tie: run on ``near_tie_copy`` of the model, below)."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.training import route_replay
from spmd_rl.engines.training.logprobs import build_batch, lm_response_logprobs
from spmd_rl.engines.fsdp.packing import pack, packed_response_logprobs
from spmd_rl.engines.vllm.engine import VllmRollout


def near_tie_copy(folder: str) -> str:
    """A copy of the model whose router rows 0 and 1 differ by a tiny random vector in every layer
    (w1 = w0 + 1e-3 * rms(w0) * noise): experts 0 and 1 are always adjacent in the ranking and,
    where they straddle the top-k boundary, the choice rests on a logit gap of about 1e-4 of the
    logit, far above float32's rounding and below bfloat16's. A trained tiny model's own margins
    depend on the CPU that built it (on an AVX2-only build no bf16 decision differed), so the
    bf16 check makes its near-ties rather than hoping for them."""
    out = Path(tempfile.mkdtemp(prefix="near-tie-"))
    for f in Path(folder).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(Path(folder) / "model.safetensors"))
    noise = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w[1] = w[0] + 1e-3 * w[0].pow(2).mean().sqrt() * torch.randn(w.shape[1], generator=noise)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def plant_stale_table(worker) -> None:
    runner = worker.model_runner
    runner._route_tables["stale"] = np.zeros((3, runner._route_layers, 2), np.uint8)
    runner._route_lengths["stale"] = 3


def table_names(worker) -> list[str]:
    return sorted(worker.model_runner._route_tables)


def own_replay(model, batch, routes):
    """Independent replay: every sparse block's forward recomputed from the recorded experts
    (gate = softmax over every expert, gathered, renormalised), own top-k where none."""
    b, t = batch.input_ids.shape
    layers, k = routes[0].shape[1:]
    table = torch.full((b, t, layers, k), -1, dtype=torch.long)
    for i, r in enumerate(routes):
        table[i, : r.shape[0]] = r.long()

    def block_forward(block, layer):
        def forward(hidden):
            flat = hidden.reshape(-1, hidden.shape[-1])
            probs = F.softmax(F.linear(flat, block.gate.weight), dtype=torch.float, dim=-1)
            own = probs.topk(block.gate.top_k, dim=-1).indices
            given = table[:, :, layer].reshape(-1, k)
            idx = torch.where(given[:, :1] >= 0, given, own)
            w = probs.gather(1, idx)
            w = (w / w.sum(-1, keepdim=True)).to(flat.dtype)
            out = torch.zeros_like(flat)
            for j in range(k):
                for e in idx[:, j].unique().tolist():
                    rows = (idx[:, j] == e).nonzero()[:, 0]
                    gate, up = F.linear(flat[rows], block.experts.gate_up_proj[e]).chunk(2, dim=-1)
                    out[rows] += w[rows, j, None] * F.linear(F.silu(gate) * up, block.experts.down_proj[e])
            return out.reshape(hidden.shape)

        return forward

    saved = []
    for layer, dec in enumerate(model.model.layers):
        saved.append(dec.mlp.forward)
        dec.mlp.forward = block_forward(dec.mlp, layer)
    try:
        return lm_response_logprobs(model, batch)[0]
    finally:
        for dec, f in zip(model.model.layers, saved):
            dec.mlp.forward = f


if __name__ == "__main__":
    folder, dtype = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["near-tie"]:
        folder = near_tie_copy(folder)
    cfg = RolloutConfig(n=4, max_response_length=12, temperature=1.0)
    engine = VllmRollout.build(
        folder, detect("cpu"), cfg, tp=1, dtype=dtype, max_model_len=64, seed=0, distributed=False, record_routes=True
    )
    prompts = [[5, 17, 30, 41, 9, 12], [7, 8, 100, 3], [60, 61, 62, 63, 64, 65, 66, 67]]
    samples = engine.generate(prompts, n=4, max_tokens=12, seed=3)
    longest = max(samples[:4], key=lambda s: len(s.token_ids))  # a sample may end before 3 tokens
    prefix = prompts[0] + longest.token_ids[:3]
    partial = engine.continue_samples([(prefix, 5)], seed=4)[0]
    # a batch starts from no route tables: one planted in the worker as an unfinished request's
    # would be (``RouteCapture.drop_routes``, called by ``_begin_batch``) is gone after the next
    engine.llm.collective_rpc(plant_stale_table)
    planted = engine.llm.collective_rpc(table_names)[0]
    engine.generate([prompts[1]], n=1, max_tokens=2, seed=9)
    left_after_batch = engine.llm.collective_rpc(table_names)[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    resp = [torch.tensor(s.token_ids) for s in samples]
    prom = [torch.tensor(prompts[i // 4]) for i in range(len(samples))]
    batch = build_batch(prom, resp, 0, [s.routes for s in samples], (layers, k))
    rollout = torch.zeros_like(batch.mask, dtype=torch.float32)
    for i, s in enumerate(samples):
        rollout[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    route_replay.patch_hf(model)
    out = {}
    with torch.no_grad():
        sizes = batch.input_ids.numel()
        width = batch.input_ids.shape[1]
        lengths = batch.attention_mask.sum(1).tolist()
        for name, replay in (("own", False), ("replay", True)):
            route_replay.take_sums()
            routes, valid = route_replay.place(lengths, sizes, lambda b, t: b * width + t, batch.routes)
            with route_replay.feeding(routes, valid, replay):
                out[name] = lm_response_logprobs(model, batch)[0]
            out[name + "_sums"] = route_replay.take_sums()
        p = pack(batch)
        start = (p.last + 1 - torch.tensor(lengths)).tolist()
        routes, valid = route_replay.place(lengths, p.input_ids.numel(), lambda b, t: start[b] + t, batch.routes)
        with route_replay.feeding(routes, valid, True):
            out["packed"] = packed_response_logprobs(model, batch)[0]
        route_replay.take_sums()
        route_replay._current = None
        reference = own_replay(model, batch, batch.routes)
    m = batch.mask
    diff = lambda a, b: float(((a - b).abs() * m).sum() / m.sum())  # noqa: E731
    dmax = lambda a, b: float(((a - b).abs() * m).max())  # noqa: E731
    first = samples[0].routes.view(-1, layers, k)
    same_prompt = all(
        torch.equal(s.routes.view(-1, layers, k)[: len(prompts[0])], first[: len(prompts[0])]) for s in samples[:4]
    )
    print(
        json.dumps(
            {
                "layers": layers,
                "expected": [len(prompts[i // 4]) + len(s.token_ids) - 1 for i, s in enumerate(samples)],
                "partial_positions": int(partial.routes.numel() // (layers * k)),
                "partial_expected": len(prefix) + len(partial.token_ids) - 1,
                "same_prompt_routes": same_prompt,
                "tables_planted": planted,
                "tables_after_batch": left_after_batch,
                "mismatch_own": diff(out["own"], rollout),
                "mismatch_replay": diff(out["replay"], rollout),
                "replay_vs_reference_max": dmax(out["replay"], reference),
                "packed_vs_padded_max": dmax(out["packed"], out["replay"]),
                "own_sums": out["own_sums"],
                "replay_sums": out["replay_sums"],
                "metrics": route_replay.metrics(out["own_sums"]),
            }
        )
    )
    if folder != sys.argv[1]:
        shutil.rmtree(folder)
