"""``rollout.engine: hf`` (engines.hf.rollout) on the tiny model, against independent references:
its log-probs are the trainer's of the same tokens under the same policy (temperature, top-k,
top-p: an HF float32 forward through ``engines.training.logprobs``), its greedy tokens are transformers'
own ``generate``, a seeded request samples the same tokens alone or in a batch, a prompt samples
the same tokens whichever share of the iteration it is dealt into, and new weights
reach the next sample. The registry and the config agree on the engines; a build asking for what
the engine lacks is refused before it is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.config.loader import load_config
from spmd_rl.config.rollout_engines import ROLLOUTS
from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.dock.batch import DockBatch
from spmd_rl.engines.base import RolloutBuild, SamplingSpec
from spmd_rl.engines.hf.rollout import HfRollout, truncate
from spmd_rl.engines.training.logprobs import build_batch, response_logprobs
from spmd_rl.engines.rollouts import build_rollout_engine, rollout_class
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.recipe.graph import Modes
from spmd_rl.trainer.stages import StageCall, stage_fn
from spmd_rl.trainer.stages.registry import StageView
from tests.conftest import REPO, subprocess_env

T, TOP_K, TOP_P = 0.8, 20, 0.9


def build(model, **kw) -> RolloutBuild:
    cfg = RolloutConfig(engine="hf", n=4, max_response_length=8, temperature=T, top_k=TOP_K, top_p=TOP_P)
    return RolloutBuild(model, detect("cpu"), cfg, 1, "float32", 64, distributed=False, **kw)


@pytest.fixture(scope="module")
def prompts(tiny_model) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return [tok(text).input_ids for text in ("12+30=", "7+5=", "100+250=")]


@pytest.fixture(scope="module")
def engine(tiny_model) -> HfRollout:
    return build_rollout_engine(build(tiny_model))


def trainer_logprobs(model, prompt: list[int], responses: list[list[int]], policy: SamplingPolicy) -> list:
    batch = build_batch([torch.tensor(prompt)] * len(responses), [torch.tensor(r) for r in responses], 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = response_logprobs(logits, batch, policy=policy)[0]
    return [lp[k, : len(r)] for k, r in enumerate(responses)]


@pytest.mark.parametrize("top_k, top_p", [(TOP_K, TOP_P), (3, 1.0)])  # the second: top-k alone decides the set
def test_sampled_logprobs_are_the_trainers_under_temperature_top_k_and_top_p(tiny_model, prompts, top_k, top_p):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = RolloutConfig(engine="hf", n=4, max_response_length=8, temperature=T, top_k=top_k, top_p=top_p)
    engine = build_rollout_engine(RolloutBuild(tiny_model, detect("cpu"), cfg, 1, "float32", 64, distributed=False))
    samples = engine.generate(prompts, n=4, max_tokens=8, seed=11)
    assert len(samples) == 12 and all(s.token_ids for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) >= 3  # it sampled, not 12 copies of one answer
    for p, prompt in enumerate(prompts):
        group = samples[4 * p : 4 * p + 4]
        want = trainer_logprobs(model, prompt, [s.token_ids for s in group], SamplingPolicy(T, top_k, top_p))
        for s, lp in zip(group, want):
            assert len(s.logprobs) == len(s.token_ids)
            # float32: HF generate's incremental (KV-cache) forward vs the trainer's full forward, ~1e-6-1e-5 apart
            assert (torch.tensor(s.logprobs) - lp).abs().max() < 1e-4
    # and not those of the untruncated policy: the check can tell top-k / top-p apart
    plain = trainer_logprobs(model, prompts[0], [s.token_ids for s in samples[:4]], SamplingPolicy(T))
    assert max(float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples[:4], plain)) > 1e-3


def test_greedy_tokens_are_transformers_generate(tiny_model, engine, prompts):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    got = engine.generate(prompts, n=2, max_tokens=8, temperature=0.0)
    for p, prompt in enumerate(prompts):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        assert got[2 * p].token_ids == got[2 * p + 1].token_ids == out[:cut]
        assert got[2 * p].stopped == (cut < len(out) or out[-1] in eos)


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(engine, prompts):
    alone = engine.continue_samples([(prompts[1], 8)], seed=5)[0]
    engine.submit([("a", prompts[0]), ("b", prompts[1]), ("c", prompts[2])], [SamplingSpec(8, T, s) for s in (9, 5, 3)])
    batched = dict(engine.step())
    assert not engine.busy()
    (got,) = batched["b"]
    # float32: batched (padded) vs alone generation forwards, other shapes; ~1e-6
    assert got.token_ids == alone.token_ids and got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    again = engine.continue_samples([(prompts[1], 8)], seed=6)[0]
    other = engine.continue_samples([(prompts[1], 8)], seed=5)[0]
    assert other.token_ids == alone.token_ids and (
        again.token_ids != alone.token_ids or again.logprobs != alone.logprobs
    )


def test_a_prompt_samples_the_same_tokens_whichever_share_it_is_dealt_into(engine, prompts):
    whole = engine.generate(prompts, n=2, max_tokens=8, seed=21)
    tail = engine.generate(prompts[1:], n=2, max_tokens=8, seed=21, seed_keys=[2, 4])
    assert [s.token_ids for s in whole[2:]] == [s.token_ids for s in tail]
    unkeyed = engine.generate(prompts[1:], n=2, max_tokens=8, seed=21)  # keyed by place in the share: not the same
    assert [s.token_ids for s in unkeyed] != [s.token_ids for s in tail]
    apart = engine.continue_samples([(prompts[0], 8), (prompts[2], 8)], seed=4, seed_keys=[9, 3])
    assert engine.continue_samples([(prompts[2], 8)], seed=4, seed_keys=[3])[0].token_ids == apart[1].token_ids
    with pytest.raises(ValueError, match="1 seed keys for 2 prompts"):
        engine.generate(prompts[:2], n=2, max_tokens=8, seed=21, seed_keys=[0])


def test_the_rollout_stage_samples_a_group_the_same_in_any_share(tiny_model, prompts):
    """The stage keys each request by its dataset row: a share holding groups 1 and 2 (another
    DP group's, or a replica's after a peer's loss, numbered from 0 in its own dock) samples
    what the share of all three did.
    Temperature 2: the tiny model's answers to these prompts are near-certain at T = 0.8."""
    cfg = load_config(Path(REPO / "configs/quickstart.yaml"), ["rollout.n=2", "rollout.max_response_length=8"])
    hot = RolloutConfig(engine="hf", n=2, max_response_length=8, temperature=2.0, top_k=-1, top_p=1.0)
    engine = build_rollout_engine(RolloutBuild(tiny_model, detect("cpu"), hot, 1, "float32", 64, distributed=False))
    view = StageView(cfg=cfg, modes=Modes.of(cfg), rollout=engine)

    def responses(groups: list[int]) -> dict[int, list[int]]:
        idx = torch.tensor([2 * g + k for g in groups for k in range(2)])
        cols = {
            "prompt_ids": [torch.tensor(prompts[int(i) // 2]) for i in idx],
            "prompt_row": [torch.tensor(40 + int(i) // 2) for i in idx],  # the dataset rows of groups 0, 1, 2
        }
        local = idx - 2 * groups[0]  # a dock numbers its share from 0
        out = stage_fn("actor_rollout")(
            StageCall(view, 3, None, DockBatch(local, cols, frozenset()), True, local.tolist())
        )
        return {int(i): r.tolist() for i, r in zip(idx, out.columns["response_ids"])}  # by group and sample

    whole, share = responses([0, 1, 2]), responses([1, 2])
    assert share == {i: whole[i] for i in share} and len(share) == 4
    assert len({tuple(r) for r in whole.values()}) >= 4  # sampled, not one near-certain answer


def test_truncation_keeps_the_top_k_then_the_top_p_mass():
    x = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(truncate(x, 3, 1.0)).tolist() == [[True, True, True, False, False]]
    # top-p 0.8 drops the smallest tokens whose mass from below is <= 0.2: 0.05 + 0.1 (0.15), not 0.15 more
    assert torch.isfinite(truncate(x, -1, 0.8)).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(truncate(x, -1, 0.01)).tolist() == [[True, False, False, False, False]]


def test_a_dummy_start_refuses_to_generate_and_loads_every_weight(tiny_model, prompts):
    dummy = HfRollout(build(tiny_model, dummy_weights=True))
    with pytest.raises(RuntimeError, match="no policy weights"):
        dummy.generate(prompts, n=1, max_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    weights = list(model.state_dict().items())
    with pytest.raises(ValueError, match=r"left \['model.norm.weight'\] unset"):
        dummy.update_weights([(n, t) for n, t in weights if n != "model.norm.weight"])
    with torch.no_grad():
        for _, t in weights:
            t.add_(0.01 * torch.randn_like(t))  # weights the checkpoint never held
    dummy.update_weights(weights)
    got = dummy.generate(prompts[:1], n=1, max_tokens=8, temperature=0.0)[0]
    out = model.generate(torch.tensor(prompts[:1]), max_new_tokens=8, do_sample=False)[0, len(prompts[0]) :].tolist()
    assert got.token_ids == out[: len(got.token_ids)] and len(got.token_ids) >= 1
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        dummy.update_weights([("nope", torch.zeros(1))])


def test_the_one_table_names_the_engines_their_classes_carry_its_capabilities_and_lacks_are_refused(tiny_model):
    assert sorted(ROLLOUTS) == ["hf", "vllm"] and ROLLOUTS.meta["hf"] is HfRollout.capabilities
    assert (
        rollout_class("hf") is HfRollout
        and rollout_class("tests.helpers.rollouts:EchoRollout").__name__ == "EchoRollout"
    )
    with pytest.raises(ValueError, match="unknown rollout engine 'nope'; registered: vllm, hf"):
        RolloutConfig(engine="nope", n=1, max_response_length=1)
    with pytest.raises(
        ValueError, match=r"rollout.engine='hf' cannot serve this run: tensor_parallel: .*parallel.gen.tp=1"
    ):
        build_rollout_engine(
            RolloutBuild(
                tiny_model, detect("cpu"), RolloutConfig(engine="hf", n=1, max_response_length=1), 2, "float32", 64
            )
        )


@pytest.mark.slow
def test_spmd_rl_eval_with_the_hf_engine_scores_what_transformers_generate_scores(tiny_model):
    """``spmd-rl eval --engine hf`` in a fresh process: its greedy accuracy on 32 held-out prompts
    is the one transformers' own ``generate`` gives on the same prompts (chat template, greedy,
    8 tokens, the run's reward rule); an unknown engine is a user error naming the option."""
    from spmd_rl.data.prompts import PromptFormat, load_prompts
    from spmd_rl.rewards import get_reward

    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model), "--data", str(tiny_model / "test.jsonl"),
         "--limit", "32", "--engine", "hf"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = load_prompts(tiny_model / "test.jsonl", tok, PromptFormat(), max_prompt_length=10**6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rule, right = get_reward("exact_match"), 0
    for ids, answer in zip(prompts.prompt_ids[:32], prompts.answers[:32]):
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
        right += rule(tok.decode(out, skip_special_tokens=True), answer) > 0.5
    assert got["prompts"] == 32 and got["accuracy"] == right / 32, (got, right)
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model), "--data", str(tiny_model / "test.jsonl"),
         "--engine", "nope"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 2 and "rollout.engine='nope'" in res.stderr and "unknown rollout engine" in res.stderr


def test_an_engines_own_settings_are_refused_for_another_engine(in_repo, tiny_model):
    """``rollout.vllm.*`` is read by the vLLM engine only (its catalog entry names the section):
    set beside ``rollout.engine: hf`` it is refused, naming the field; left unset it is not."""
    from spmd_rl.config.loader import load_config
    from spmd_rl.recipe.rules import check

    hf = ["rollout.engine=hf", "parallel.gen.tp=1"]
    assert not [v for v in check(load_config("configs/quickstart.yaml", hf))[1] if v.field.startswith("rollout.")]
    got = check(load_config("configs/quickstart.yaml", [*hf, "rollout.vllm.enforce_eager=false"]))[1]
    assert [str(v) for v in got if v.field.startswith("rollout.vllm")] == [
        "rollout.vllm.enforce_eager=False: read only by the vllm engine; rollout.engine is hf -> remove it, or set "
        "rollout.engine: vllm"
    ]
    assert not check(load_config("configs/quickstart.yaml", ["rollout.vllm.enforce_eager=false"]))[1]
