"""Checkpoint -> HF folder (or a LoRA checkpoint -> PEFT adapter folder), and greedy evaluation
of an HF folder through vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.engines.training import fused_experts, lora
from spmd_rl.trainer.checkpoint import model_weights, read_state


def export(checkpoint_dir: str | Path, out: str | Path, merged: bool = False) -> Path:
    """Write the actor of a DCP checkpoint as a standard HF folder (safetensors + tokenizer),
    using the base model's config. A LoRA checkpoint (adapters only) becomes its adapter folder
    in PEFT's layout, or with ``merged`` the HF model with W + (alpha / r) B A."""
    state = read_state(checkpoint_dir)
    weights = model_weights(checkpoint_dir)
    out = Path(out)
    if "lora" in state and not merged:
        return write_adapter(weights, state, out)
    model = AutoModelForCausalLM.from_pretrained(state["model_path"], dtype=torch.float32)
    if "lora" in state:
        merge_adapters(model, weights, state["lora"])
        weights = {}
    for name, p in model.named_parameters():  # a megatron checkpoint names MoE experts one by one, as HF files do
        parts = fused_experts.checkpoint_names(name, p.shape[0])
        if fused_experts.is_fused(name) and name not in weights and all(n in weights for n in parts):
            weights[name] = fused_experts.read(weights.__getitem__, name, p.shape[0])
            for n in parts:
                del weights[n]
    if weights:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise ValueError(
                f"checkpoint does not match the base model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(state["tokenizer_path"]).save_pretrained(out)
    return out


@torch.no_grad()
def merge_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor], cfg: dict) -> None:
    """W += (alpha / r) B A for every adapted linear layer, in float32 (``engines.training.lora``)."""
    params = dict(model.named_parameters())
    scale = cfg["alpha"] / cfg["rank"]
    for name in sorted(n[: -len(".lora_A")] for n in adapters if n.endswith(".lora_A")):
        if f"{name}.weight" not in params:
            raise ValueError(f"adapter {name!r} of the checkpoint names no layer of the base model {cfg}")
        w = params[f"{name}.weight"]
        w += (scale * adapters[f"{name}.lora_B"].float() @ adapters[f"{name}.lora_A"].float()).to(w.dtype)


def write_adapter(adapters: dict[str, torch.Tensor], state: dict, out: Path) -> Path:
    """PEFT's adapter folder (``engines.training.lora.write_peft_folder``) with the tokenizer beside it."""
    cfg = state["lora"]
    lora.write_peft_folder(
        out,
        adapters,
        str(Path(state["model_path"]).resolve()),
        cfg["rank"],
        cfg["alpha"],
        cfg["dropout"],
        cfg["target_modules"],
    )
    AutoTokenizer.from_pretrained(state["tokenizer_path"]).save_pretrained(out)
    return out


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "trainer_state.json").is_file()


def greedy_accuracy(  # noqa: PLR0913
    model_dir: str | Path,
    data: str | Path,
    rule: str = "exact_match",
    limit: int | None = None,
    max_tokens: int = 8,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    environment: str | None = None,
    max_turns: int = 4,
    engine: str = "vllm",
) -> dict:
    """Greedy accuracy on a prompt file through a rollout engine (``rollout.engine``, single process). With an
    ``environment`` each prompt is a greedy multi-turn trajectory of at most ``max_tokens``
    response tokens (``envs.multi_turn``), scored on its last sampled turn."""
    from spmd_rl.config.schema import RolloutConfig
    from spmd_rl.data.prompts import PromptFormat, load_prompts, with_pad_token
    from spmd_rl.distributed.accelerator import detect
    from spmd_rl.engines.base import RolloutBuild
    from spmd_rl.engines.rollouts import build_rollout_engine
    from spmd_rl.rewards import get_reward
    from spmd_rl.rewards.registry import score_of

    tok = with_pad_token(AutoTokenizer.from_pretrained(model_dir))
    prompts = load_prompts(data, tok, PromptFormat(prompt_column, answer_column), max_prompt_length=10**6)
    ids, answers = prompts.prompt_ids[:limit], prompts.answers[:limit]
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    rollout = build_rollout_engine(
        RolloutBuild(
            model_dir,
            detect("auto"),
            RolloutConfig(engine=engine, n=1, max_response_length=max_tokens),
            tp=1,
            dtype="float32",
            max_model_len=min(cfg.get("max_position_embeddings", 4096), 4096),
            distributed=False,
        )
    )
    if environment is not None:
        from spmd_rl.envs.factory import environment_factory
        from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits

        turns = MultiTurnRollout(
            rollout, tok, environment_factory(environment), TurnLimits(max_turns, max_tokens, 10.0)
        )
        texts = [
            t.last_text
            for t in turns.run([(p, prompts.environment_row(i)) for i, p in enumerate(ids)], temperature=0.0)
        ]
    else:
        samples = rollout.generate(ids, n=1, max_tokens=max_tokens, temperature=0.0)
        texts = tok.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    fn = get_reward(rule)
    correct = sum(score_of(fn(t, a, prompts.info(i)), rule)[0] > 0.5 for i, (t, a) in enumerate(zip(texts, answers)))
    return {"model": str(model_dir), "data": str(data), "prompts": len(ids), "correct": correct} | {
        "accuracy": correct / len(ids)
    }
