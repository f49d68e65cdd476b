"""Rewards by name or module:function; datasets skip bad rows naming them; the sampler resumes."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from spmd_rl.data.prompts import PromptFormat, load_prompts
from spmd_rl.data.sampler import PromptSampler, SamplerState
from spmd_rl.rewards import get_reward, reward_for


def test_exact_match():
    f = get_reward("exact_match")
    assert f("67", "67", {}) == 1.0 and f(" 67 ", "67", {}) == 1.0 and f("67.0", "67", {}) == 1.0
    assert f("68", "67", {}) == 0.0 and f("", "67", {}) == 0.0 and f("6 7", "67", {}) == 0.0


def test_user_reward_by_module_function(caplog):
    """A user's (response, answer, row) function is called as it is; 0.1's two-argument form
    is called without the row, with a warning naming the rule."""
    from tests.helpers import rewards

    assert get_reward("tests.helpers.rewards:last_number") is rewards.last_number
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        f = get_reward("math:isclose")  # a callable(response, answer)
    assert f(1.0, 1.0, {"data_source": ""}) is True and f(1.0, 2.0, {}) is False
    assert "reward.rule=math:isclose takes (response, answer)" in caplog.text
    with pytest.raises(ValueError, match="no function"):
        get_reward("math:nope")


@pytest.mark.parametrize(
    "extract,right,wrong,unformed",
    [
        ("strict", " 1,234 ", "1234.5", "it is 1234"),
        ("gsm8k", "so 1200 + 34\n#### 1,234", "#### 1234 then 12\n#### 12", "1234"),
        ("boxed", "thus \\boxed{1234}.", "\\boxed{1234} no, \\boxed{12}", "\\boxed{1234"),
        ("last_number", "1200 + 34 = 1234", "1234 or 1235", "no number here"),
    ],
)
def test_exact_match_finds_the_answer_where_extract_says(extract, right, wrong, unformed):
    """``reward.extract``: the same reward on the whole response, GSM8K's last ``####``, the last
    ``\\boxed{}`` (braces balanced; an unclosed one is no answer) or the last number; with a
    format score, a wrong but found answer scores it and no answer scores 0."""
    f = get_reward("exact_match", format_score=0.1, extract=extract)
    assert (f(right, "1234", {}), f(wrong, "1234", {}), f(unformed, "1234", {})) == (1.0, 0.1, 0.0)


def test_a_reward_returning_no_score_is_named():
    from spmd_rl.rewards.registry import score_of

    assert score_of(0.5, "r") == (0.5, {}) and score_of({"score": 1, "len": 3}, "r") == (1.0, {"len": 3.0})
    for bad in (None, "1", {"len": 3}, {"score": 1, "tag": "x"}):
        with pytest.raises(TypeError, match="reward.rule=my:fn returned"):
            score_of(bad, "my:fn")


def test_bad_rows_are_skipped_and_named(tmp_path, tiny_model, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"question": "x", "answer": "1"},
        {"prompt": "  ", "answer": "1"},
        {"prompt": "9" * 200, "answer": "1"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        ps = load_prompts(path, tok, PromptFormat(), max_prompt_length=64)
    assert ps.rows == [0, 4] and ps.answers == ["2", "4"]
    assert ps.skipped == {
        "missing field 'prompt'": [1],
        "empty prompt": [2],
        "prompt of 219 tokens > data.max_prompt_length=64": [3],
    }
    assert "row [1]" in caplog.text or "e.g. row [1]" in caplog.text


def test_sampler_is_deterministic_and_resumable():
    a = PromptSampler(10, seed=3)
    first = [a.next_batch(4) for _ in range(4)]  # crosses an epoch boundary
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    b = PromptSampler(10, seed=3)
    b.next_batch(4)
    resumed = PromptSampler(10, seed=3, state=SamplerState(b.state.epoch, b.state.offset))
    assert [resumed.next_batch(4) for _ in range(3)] == first[1:]


def test_parquet_prompts(tmp_path, tiny_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "3+4=", "a": "7"}, {"q": "", "a": "0"}]), str(path))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ps = load_prompts(path, tok, PromptFormat("q", "a"), max_prompt_length=64)
    assert ps.answers == ["7"] and ps.skipped == {"empty prompt": [1]}
    assert tok.decode(ps.prompt_ids[0]).endswith("3+4=<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("chat_template", [True, False])
def test_batched_encoding_equals_the_tokenizers_one_prompt_calls(tmp_path, tiny_model, chat_template):
    """``load_prompts`` tokenizes all rows in one call; each row's ids are what transformers gives
    for that prompt alone (``apply_chat_template(tokenize=True)`` or ``encode``), in row order,
    with skipped rows in between (a batch shifted by one row would fail here)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = [json.loads(line)["prompt"] for line in (tiny_model / "train.jsonl").read_text().splitlines()[:200]]
    texts[7:7] = ["  leading space", "tab\tand\nnewline", "<|im_start|>user", "é ü 漢字", "9" * 70]
    rows = [{"prompt": t, "answer": "1"} for t in texts]
    rows.insert(3, {"prompt": "", "answer": "1"})
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts(path, tok, PromptFormat(chat_template=chat_template), max_prompt_length=64)

    def alone(t: str) -> list[int]:
        if chat_template:
            return list(
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return tok.encode(t, add_special_tokens=False)

    want = [(i, alone(r["prompt"])) for i, r in enumerate(rows) if r["prompt"]]
    kept = [(i, ids) for i, ids in want if len(ids) <= 64]
    assert len(kept) < len(want)  # the long prompt was measured in tokens and skipped
    assert list(zip(ps.rows, ps.prompt_ids)) == kept


def test_the_run_reads_reward_extract(in_repo, tiny_model):
    """The run's reward is built from ``reward.rule``, ``reward.format_score`` and
    ``reward.extract`` (``Trainer``'s construction): a GSM8K answer scores under gsm8k, not
    under the default strict."""
    import inspect

    from spmd_rl.config.loader import load_config
    from spmd_rl.trainer import trainer

    assert "reward_fn=reward_for(cfg.reward)" in inspect.getsource(trainer)
    for extract, want in (("gsm8k", 1.0), ("strict", 0.0)):
        cfg = load_config("configs/quickstart.yaml", [f"reward.extract={extract}"])
        rule = reward_for(cfg.reward)
        assert rule("2 + 5 = 7\n#### 7", "7", {}) == want


def test_validate_checks_that_math_verify_imports(in_repo, monkeypatch):
    """``reward.rule: math_verify`` without the package fails at ``validate``, not at the first
    reward (the cpu, cuda and npu extras install it)."""
    from spmd_rl.config.loader import load_config
    from spmd_rl.recipe import model_rules
    from spmd_rl.recipe.rules import check

    cfg = load_config("configs/quickstart.yaml", ["reward.rule=math_verify"])
    assert not [v for v in check(cfg)[1] if v.field == "reward.rule"]  # installed here
    real = model_rules.findable
    monkeypatch.setattr(model_rules, "findable", lambda p: False if p.startswith("math_verify") else real(p))
    assert [str(v) for v in check(cfg)[1] if v.field == "reward.rule"] == [
        "reward.rule='math_verify': the math-verify package is not installed -> pip install math-verify"
    ]
