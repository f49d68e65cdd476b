"""Rules of DPO (``algorithm.name: dpo``, a spec with ``advantage="preference"``): an offline
graph with no rollout engine, so every field that configures generation-time behaviour is
refused rather than ignored, and the DPO fields are refused outside DPO."""

from __future__ import annotations

from spmd_rl.algos.specs import spec_named
from spmd_rl.config.errors import Violation
from spmd_rl.config.schema import Config
from spmd_rl.recipe.train_backends import train_backend
from spmd_rl.recipe.graph import Modes

_DPO_FIELDS = ("dpo_beta", "dpo_label_smoothing")
_DPO_DATA_FIELDS = ("chosen_column", "rejected_column")


def check_dpo(cfg: Config) -> list[Violation]:
    al = cfg.algorithm
    if spec_named(al.name).advantage != "preference":
        return [
            Violation(f"{section}.{f}", getattr(obj, f), "only read by algorithm.name: dpo", "remove it")
            for section, obj, names in (("algorithm", al, _DPO_FIELDS), ("data", cfg.data, _DPO_DATA_FIELDS))
            for f in names
            if f in obj.model_fields_set
        ]
    out = []
    if cfg.rollout.n != 2:
        out.append(
            Violation(
                "rollout.n",
                cfg.rollout.n,
                "DPO puts each prompt twice, once per response of its pair",
                "set rollout.n: 2",
            )
        )
    if cfg.eval.interval:
        out.append(
            Violation(
                "eval.interval",
                cfg.eval.interval,
                "the in-run eval samples greedily through vLLM, and DPO builds no rollout engine",
                "set eval.interval: 0 (each iteration logs dpo_margin and dpo_accuracy; export the checkpoint "
                "to evaluate it)",
            )
        )
    generates = "DPO generates nothing"
    plain = (
        "DPO scores its pairs under the model's plain softmax, as `eval --pairs` does; a sampling temperature or "
        "truncation would change the objective"
    )
    m = Modes.of(cfg)
    refused = {  # field: (refused?, the value shown, why)
        "parallel.placement": (m.separated, "separated", generates),
        "stream.partial_tokens": (m.partial_rollout, cfg.stream.partial_tokens, generates),
        "stream.fuse": (cfg.stream.fuse, True, generates),
        "rollout.environment": (m.multi_turn, cfg.rollout.environment, generates),
        "actor.moe.router_replay": (m.records_routes, cfg.actor.moe.router_replay, generates),
        "algorithm.kl_coef": (al.kl_coef > 0, al.kl_coef, "DPO's tie to the reference is algorithm.dpo_beta"),
        "actor.backend": (
            not train_backend(cfg).preference_pairs,
            cfg.actor.backend,
            "DPO runs on the FSDP backend in this version",
        ),
        "rollout.temperature": (cfg.rollout.temperature != 1.0, cfg.rollout.temperature, plain),
        "rollout.top_k": (cfg.rollout.top_k != -1, cfg.rollout.top_k, plain),
        "rollout.top_p": (cfg.rollout.top_p != 1.0, cfg.rollout.top_p, plain),
    }
    out += [
        Violation(field, value, why, f"remove {field} with algorithm.name: dpo")
        for field, (bad, value, why) in refused.items()
        if bad
    ]
    return out
