"""torchrun worker: the megatron-core engine against the FSDP2 engine on the same batch.

Env: MODEL, TP (megatron's TP; sequence parallel when TP > 1), PP (pipeline stages, default 1;
megatron's DP is world / (TP x PP)), EP (expert parallelism over the DP ranks, MoE models;
default 1), DTYPE, SPMD_RL_OUT, ROUTES (set: MoE routing replay of random routes, compared
after the other checks). The FSDP engine always runs dp_shard = world. Writes rank<k>.json: the largest
log-prob difference before and after one update, the two grad norms, the largest weight
difference after the update (full HF tensors from each engine's ``full_weights``), and what the
weight sync yields (names and shapes, against ``weight_shapes`` and the HF checkpoint).
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV  # noqa: E402
from spmd_rl.launcher.preload import delegate  # noqa: E402

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs (vLLM unused here)


import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import train_mesh
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.engines.training.hf_weights import SafetensorsFolder
from spmd_rl.engines.training.logprobs import build_batch, split
from spmd_rl.engines.megatron.engine import MegatronEngine
from spmd_rl.engines.fsdp.engine import TrainEngine


def batch_of(n: int, seed: int):
    """n samples of random prompts (3-9 tokens) and responses (1-12 tokens), right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(3, 200, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g) for _ in range(n)]
    return build_batch(prompts, responses, pad_id=0), torch.randn(n, generator=g)


def with_random_routes(batch, layers: int, experts: int, k: int, seed: int):
    """The batch with a random set of k distinct experts at every routed position (P + R - 1
    of each sample): far from any router's own choice, so a misplaced row changes log-probs."""
    g = torch.Generator().manual_seed(seed)
    routes = []
    for n in (batch.attention_mask.sum(1) - 1).tolist():
        routes.append(torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8))
    return type(batch)(batch.input_ids, batch.attention_mask, batch.predictor, batch.targets, batch.mask, routes)


def replayed_logprobs(fsdp, mega, share, fdp: int, mdp: int) -> dict:
    """Both engines, fresh (an update moves rarely chosen experts apart: Adam's first step),
    replay the same random routes: their log-probs, without routes too, and router statistics."""
    from spmd_rl.engines.training import route_replay

    out = {}
    for name, engine, dp in (("fsdp", fsdp, fdp), ("megatron", mega, mdp)):
        mine, _ = share(dp)
        route_replay.take_sums()
        out[f"lp_{name}"] = engine.infer(split(mine, 3))[0].tolist()
        out[f"own_{name}"] = engine.infer(split(type(mine)(*mine._fields()), 3))[
            0
        ].tolist()  # the same samples, no routes
        out[f"sums_{name}"] = route_replay.take_sums()
    return out


def replayed_grad_norms(fsdp, mega, share, tokens, fdp: int, mdp: int, batch, objective: bool) -> list[float]:
    """One update of each engine replaying the routes, FSDP in micro-batches of 4 and megatron
    of 2: the gradient reaches the routers through the replayed experts' gate weights (mcore's
    softmax of the chosen logits, HF's renormalised probabilities). With ``objective``, the
    router terms of actor.moe.aux_loss_coef = 0.5 and actor.moe.z_loss_coef = 0.05 alone (the
    policy term times 0, so a wrong scale, f, T or layer mean shows in full), their f and T the
    whole batch's (what the update stage hands them, ``actor_update.router_objective``)."""
    from spmd_rl.algos import router_loss
    from spmd_rl.engines.training import route_replay

    norms = []
    for engine, dp, size in ((fsdp, fdp, 4), (mega, mdp, 2)):
        mine, a = share(dp)
        micros = split(mine, size)
        router = None
        if objective:
            counts = router_loss.load_fractions(batch.routes, 4)
            router = route_replay.RouterObjective(
                0.5, 0.05, (counts / counts.sum(1, keepdim=True)).float(), float(batch.attention_mask.sum()), 4, dp
            )

        def loss_fn(lp, ent, k, micros=micros, a=a, dp=dp, size=size):
            if objective:
                return (lp * 0).sum()
            return -(lp * a[k * size : (k + 1) * size, None] * micros[k].mask.to(lp.dtype)).sum() / tokens * dp

        norms.append(engine.train_step(micros, loss_fn, router=router)["grad_norm"])
    if objective:
        sums = route_replay.take_sums()
        norms += [sums["aux"], sums["z"]]
    return norms


def float64_logprobs(model: str, batch) -> torch.Tensor:
    """[B, R] log-probs of the batch's response tokens under the HF model in float64 (0 where
    masked): the reference both backends' float32 round-off is measured against."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    rows = torch.log_softmax(logits, -1).gather(1, batch.predictor[:, :, None].expand(-1, -1, logits.shape[-1]))
    return rows.gather(2, batch.targets[:, :, None]).squeeze(2) * batch.mask


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.full_weights(torch.float32, float("inf"))[1]}


def checkpoint_round_trip(mega, fresh, step, dp: int, folder: Path, rank: int) -> dict:
    """The first run (no checkpoint in ``folder`` yet) saves after its first update, takes a
    second one and records the weights after each; a run in another layout loads that
    checkpoint into a new engine (``fresh()``: no AdamW state yet, as after a restart) and takes
    the same second update. Returns the largest differences."""
    from safetensors.torch import load_file, save_file

    ckpt = folder / "ckpt"
    if not ckpt.exists():
        after1 = weights(mega)
        mega.save(ckpt)
        step(mega, dp, 2)
        if rank == 0:
            save_file(after1, folder / "after1.safetensors")
            save_file(weights(mega), folder / "after2.safetensors")
        else:
            weights(mega)
        dist.barrier()
        return {}
    mega = fresh()
    mega.load(ckpt)
    loaded = weights(mega)
    step(mega, dp, 2)
    after2 = weights(mega)
    ref1, ref2 = load_file(folder / "after1.safetensors"), load_file(folder / "after2.safetensors")
    from spmd_rl.trainer.checkpoint import model_weights

    exported = model_weights(ckpt) if rank == 0 else ref1  # the export path's reader (one process)
    return {
        "resumed_diff": max(float((loaded[n] - ref1[n]).abs().max()) for n in ref1),
        "second_step_diff": max(float((after2[n] - ref2[n]).abs().max()) for n in ref2),
        "second_step_moved": min(
            float((ref2[n] - ref1[n]).abs().max()) for n in ref2 if ".self_attn." in n and n.endswith("proj.weight")
        ),
        "exported_diff": max(float((exported[n].float() - ref1[n]).abs().max()) for n in ref1),
        "steps": mega.step_count,
    }


def ledger_against_plan(mega, acc, tp: int, pp: int, dtype: str, model: str, ep: int = 1) -> dict:
    """The memory ledger of the megatron actor after an update, and while generating under
    allgather-swap (its state swapped to host), against ``spmd-rl plan``'s estimate."""
    from spmd_rl.recipe.train_backends import rank_memory
    from spmd_rl.config.layout import Layouts
    from spmd_rl.config.loader import load_config
    from spmd_rl.config.model_arch import ModelArch
    from spmd_rl.config.schema import ReshardConfig
    from spmd_rl.reshard.allgather_swap import Resharder

    world = dist.get_world_size()
    rs = Resharder(mega, None, ReshardConfig(mode="allgather_swap"), dtype, acc)
    rs.record("update")
    rs.offload_train()
    rs.record("generate")
    rs.reload_train()
    cfg = load_config(
        "configs/quickstart.yaml",
        [f"model.path={model}", "actor.backend=megatron", f"model.dtype={dtype}", f"parallel.train.ep={ep}"],
    )
    plan = rank_memory(
        cfg,
        ModelArch.from_folder(model),
        Layouts(world, world, Layout(world // (tp * pp), tp, 0, pp), Layout(world, 1)),
    )
    up, gen = rs.ledger.last("update"), rs.ledger.last("generate")
    return {
        "ledger": [up[k] for k in ("actor_params", "actor_grads", "actor_optim")],
        "plan": [plan.train_params, plan.train_grads, plan.train_optim],
        "ledger_during_generation": sum(gen[k] for k in ("actor_params", "actor_grads", "actor_optim")),
    }


def main():  # noqa: PLR0915
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, dtype, model = int(os.environ["TP"]), os.environ["DTYPE"], os.environ["MODEL"]
    pp, ep = int(os.environ.get("PP", "1")), int(os.environ.get("EP", "1"))
    acc = detect("cpu")
    torch.manual_seed(0)
    routes = os.environ.get("ROUTES") is not None
    cfg = ActorConfig(
        mini_batch_size=1,
        micro_batch_size=4,
        optim={"lr": 1e-3, "grad_clip": 1e9, "weight_decay": 0.01},
        moe={"router_replay": "rollout" if routes else "none"},
    )
    fsdp = TrainEngine(model, acc, train_mesh(acc, Layout(world, 1)), cfg, dtype, total_steps=4)
    mega = MegatronEngine(
        model,
        acc,
        cfg,
        dtype,
        tp,
        sequence_parallel=tp > 1 and os.environ.get("SP", "1") == "1",
        total_steps=4,
        pp=pp,
        ep=ep,
    )
    batch, adv = batch_of(16, seed=1)
    tokens = batch.mask.sum()

    def share(dp: int):
        """This rank's samples when the batch is split over dp data-parallel groups."""
        r = rank // (world // dp)
        per = len(batch) // dp
        return batch[r * per : (r + 1) * per], adv[r * per : (r + 1) * per]

    def step(engine, dp: int, micro: int):
        mine, a = share(dp)
        micros = split(mine, micro)

        def loss_fn(
            lp, ent, k
        ):  # token-mean policy-gradient surrogate over the whole batch; x dp undoes the DP average
            m = micros[k].mask.to(lp.dtype)
            rows = a[k * micro : (k + 1) * micro, None]
            return -(lp * rows * m).sum() / tokens * dp

        return engine.train_step(micros, loss_fn, with_entropy=True), mine

    fdp, mdp = world, world // (tp * pp)
    out = {}
    if routes:
        from transformers import AutoConfig

        hc = AutoConfig.from_pretrained(model)
        plain, batch = (
            batch,
            with_random_routes(batch, hc.num_hidden_layers, hc.num_experts, hc.num_experts_per_tok, seed=2),
        )
        got = [None] * world
        dist.all_gather_object(got, replayed_logprobs(fsdp, mega, share, fdp, mdp))
        cat = lambda key, dp: torch.cat([torch.tensor(got[r][key]) for r in range(0, world, world // dp)])  # noqa: E731
        out["replay_logprob_diff"] = float((cat("lp_fsdp", fdp) - cat("lp_megatron", mdp)).abs().max())
        out["replay_moved_logprobs"] = float((cat("lp_fsdp", fdp) - cat("own_fsdp", fdp)).abs().max())
        out |= {"sums_fsdp": got[rank]["sums_fsdp"], "sums_megatron": got[rank]["sums_megatron"]}
        routed, batch = batch, plain
    lp_f = fsdp.infer(split(share(fdp)[0], 4))[0]
    lp_m = mega.infer(split(share(mdp)[0], 3))[0]  # another split: infer is per micro-batch
    everyone = [None] * world
    dist.all_gather_object(everyone, (lp_f.tolist(), lp_m.tolist()))
    full_f = torch.cat([torch.tensor(everyone[r][0]) for r in range(0, world, world // fdp)])
    full_m = torch.cat([torch.tensor(everyone[r][1]) for r in range(0, world, world // mdp)])
    out["logprob_diff_before"] = float((full_f - full_m).abs().max())
    if not mega.shape.experts:  # dense: each backend's float32 round-off against HF's forward in float64
        exact = float64_logprobs(model, batch)  # (HF's grouped expert matmul has no float64 kernel)
        out["logprob_err_fsdp"] = float((full_f.double() - exact).abs().max())
        out["logprob_err_megatron"] = float((full_m.double() - exact).abs().max())
    before_f = full_f
    sf, _ = step(fsdp, fdp, 4)
    sm, _ = step(mega, mdp, 2)  # another micro-batch split: the objective is split-invariant
    out |= {"grad_norm_fsdp": sf["grad_norm"], "grad_norm_megatron": sm["grad_norm"]}
    _, wf = fsdp.full_weights(torch.float32, float("inf"))
    _, wm = mega.full_weights(torch.float32, float("inf"))
    wf, wm = dict(wf), list(wm)
    out["sync_names"] = [n for n, _ in wm]
    out["sync_shapes_match"] = [(n, list(t.shape)) for n, t in wm] == mega.weight_shapes()
    out["names_match_fsdp"] = sorted(wf) == sorted(n for n, _ in wm)
    diffs = sorted(((float((wf[n] - t).abs().max()), n) for n, t in wm), reverse=True)
    out["weight_diff_after"], out["largest_weight_diffs"] = diffs[0][0], diffs[:4]
    far = sum(int(((wf[n] - t).abs() > 1e-4).sum()) for n, t in wm)
    out["weight_diff_fraction"] = far / sum(t.numel() for _, t in wm)  # elements more than 1e-4 apart
    hf = SafetensorsFolder(model)
    # every attention projection moved (an expert that no token chose moves only by weight decay)
    out["moved_from_checkpoint"] = min(
        float((hf.read(n).float() - t).abs().max()) for n, t in wm if ".self_attn." in n and n.endswith("proj.weight")
    )
    lp_f = fsdp.infer(split(share(fdp)[0], 4))[0]
    lp_m = mega.infer(split(share(mdp)[0], 4))[0]
    dist.all_gather_object(everyone, (lp_f.tolist(), lp_m.tolist()))
    full_f = torch.cat([torch.tensor(everyone[r][0]) for r in range(0, world, world // fdp)])
    full_m = torch.cat([torch.tensor(everyone[r][1]) for r in range(0, world, world // mdp)])
    out["logprob_diff_after"] = float((full_f - full_m).abs().max())
    out["logprob_moved"] = float((full_f - before_f).abs().max())  # how far the one update moved them
    out["optimizer_bytes"] = sum(t.numel() * t.element_size() for t in mega.optimizer_tensors())
    out["param_numel"] = sum(t.numel() for t in mega.param_tensors())
    if routes:
        batch = routed
        out["replay_grad_norms"] = replayed_grad_norms(fsdp, mega, share, tokens, fdp, mdp, batch, objective=False)
        out["objective_grad_norms"] = replayed_grad_norms(fsdp, mega, share, tokens, fdp, mdp, batch, objective=True)
    out |= ledger_against_plan(mega, acc, tp, pp, dtype, model, ep) | {"dp": mdp}
    if os.environ.get("CKPT"):
        fresh = lambda: MegatronEngine(
            model, acc, cfg, dtype, tp, sequence_parallel=tp > 1, total_steps=4, pp=pp, ep=ep
        )  # noqa: E731
        out |= checkpoint_round_trip(mega, fresh, step, mdp, Path(os.environ["CKPT"]), rank)
    Path(os.environ["SPMD_RL_OUT"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_after(main)
