"""The reward-model role (``reward.kind: model``) and the critic's value head:

- the score engine (FSDP2, head ``score``) equals an HF ``AutoModelForSequenceClassification``
  forward of each unpadded sequence (1e-5), on a right-padded batch of different lengths;
- the value engine starts from the actor's trunk with a zero head (every first value is 0) or
  from its own folder's head;
- under torchrun, the dock's ``reward`` column equals RM(prompt ++ response) + rule_weight x
  rule, recomputed here with HF; the pinned reward model stays resident in every stage
  (``reward.offload_to_host: false``); training on the model's reward raises it.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.training.logprobs import build_batch, split
from spmd_rl.engines.fsdp.engine import TrainEngine
from spmd_rl.rewards.registry import exact_match
from spmd_rl.reshard.ledger import ROLE_CATEGORIES
from tests.dock_dump import columns, dump_env, ledger
from tests.trainer_util import train


def _engine(folder, head: str) -> TrainEngine:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    return TrainEngine(
        folder,
        detect("cpu"),
        mesh,
        ActorConfig(mini_batch_size=1, micro_batch_size=2),
        "float32",
        trainable=False,
        head=head,
    )


def _hf_scores(folder, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> torch.Tensor:
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack(
            [hf(input_ids=torch.cat([p, r]).long()[None]).logits[0, 0] for p, r in zip(prompts, responses)]
        )


@pytest.mark.usefixtures("world_of_one")
def test_score_engine_equals_hf_forward(tiny_reward_model):
    tok = AutoTokenizer.from_pretrained(tiny_reward_model)
    prompts = [
        torch.tensor(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in ("3+4=", "12+30=", "99+1=")
    ]
    responses = [
        torch.tensor(tok.encode(a, add_special_tokens=False) + e)
        for a, e in (("7", [tok.eos_token_id]), ("41", []), ("100", [tok.eos_token_id]))
    ]
    engine = _engine(tiny_reward_model, "score")
    got, _ = engine.infer(split(build_batch(prompts, responses, tok.pad_token_id), 2))  # micro-batches pad differently
    # float32: the score engine (FSDP, right-padded micro-batches) vs HF's unpadded forward, ~1e-6 on O(1) scores
    torch.testing.assert_close(got, _hf_scores(tiny_reward_model, prompts, responses), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("world_of_one")
def test_value_head_zero_from_actor_and_read_from_its_own_folder(tiny_model, tmp_path):
    batch = build_batch(
        [torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [torch.tensor([11, 12]), torch.tensor([13, 14, 15])], 0
    )
    fresh, _ = _engine(tiny_model, "value").infer(split(batch, 2))
    assert fresh.abs().max() == 0  # the actor's folder has no value head: it starts at zero
    torch.manual_seed(0)
    own = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1)  # random head
    own.save_pretrained(tmp_path / "critic")
    values, _ = _engine(tmp_path / "critic", "value").infer(split(batch, 2))
    with torch.no_grad():
        want = (
            own.eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            .logits[..., 0]
            .gather(1, batch.predictor)
            * batch.mask
        )
    # float32: the value engine (FSDP, padded micro-batches) vs HF's forward of the same batch, ~1e-6 on O(1) values
    torch.testing.assert_close(values, want, atol=1e-5, rtol=1e-5)
    assert values.abs().max() > 0


@pytest.mark.slow
def test_reward_model_run_scores_through_the_dock_and_rises(tiny_reward_model, tmp_path, etcd):
    dump, w = tmp_path / "dump", 0.5
    few = tmp_path / "train16.jsonl"  # the same 16 prompts every iteration: the batch means are comparable
    few.write_text("".join((tiny_reward_model.parent / "train.jsonl").read_text().splitlines(keepends=True)[:16]))
    rows = train(
        tmp_path,
        "rm",
        etcd.endpoint,
        "reward.kind=model",
        f"reward.model_path={tiny_reward_model}",
        f"reward.rule_weight={w}",
        "reward.offload_to_host=false",
        "trainer.iterations=24",
        "actor.optim.lr=1e-4",
        "checkpoint.interval=0",
        "data.global_batch_size=16",
        "rollout.n=8",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=32",
        f"data.train_path={few}",
        extra_env=dump_env(dump),
    )
    model_reward = [r["reward_model_mean"] for r in rows]
    first, last = sum(model_reward[:8]) / 8, sum(model_reward[-8:]) / 8
    spread = (statistics.variance(model_reward[:8]) / 8 + statistics.variance(model_reward[-8:]) / 8) ** 0.5
    print(
        f"reward_model_mean: first 8 iterations {first:.3f}, last 8 {last:.3f} (rise {(last - first) / spread:.1f} "
        f"standard errors); "
        "per iteration",
        [round(x, 3) for x in model_reward],
    )
    assert last - first > 2 * spread  # a rise beyond the iteration-to-iteration noise, not a coin flip
    tok = AutoTokenizer.from_pretrained(tiny_reward_model)
    col = columns(dump)[0]
    idx = sorted(col["reward"])
    prompts, responses = [col["prompt_ids"][i] for i in idx], [col["response_ids"][i] for i in idx]
    rule = torch.tensor(
        [
            exact_match(tok.decode(r.tolist(), skip_special_tokens=True), col_answer(col, i))
            for r, i in zip(responses, idx)
        ]
    )
    want = _hf_scores(tiny_reward_model, prompts, responses) + w * rule
    # float32: the run's reward-model forward (padded batch) vs HF's per-sequence forward, ~1e-6 on O(1) scores
    torch.testing.assert_close(torch.stack([col["reward"][i] for i in idx]), want.float(), atol=1e-5, rtol=1e-5)
    for rank in (0, 1):
        for row in ledger(dump, rank):
            if row["phase"] in ("actor_rollout", "reward", "advantage", "actor_update"):
                assert any(row[c] for c in ROLE_CATEGORIES["reward_model"]), row  # pinned: resident in every stage


def col_answer(col, i: int) -> str:
    return col["answer"][i].numpy().tobytes().decode()
