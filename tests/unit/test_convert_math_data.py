"""``tools/convert_math_data.py``: GSM8K's and MATH's published layouts, made here in small
files, become rows the run reads as they are (answers at reward_model.ground_truth) and that
its rewards score; a row without a final answer stops the conversion naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from spmd_rl.config.loader import load_config
from spmd_rl.data.prompts import load_tokenizer, prompts_for
from spmd_rl.rewards import get_reward
from tests.conftest import REPO

TOOL = REPO / "tools/convert_math_data.py"
GSM8K = [
    {
        "question": "Tom has 3 apples and buys 1,200 more. How many?",
        "answer": "3 + 1200 = <<3+1200=1203>>1203\n#### 1,203",
    },
    {"question": "What is 6 x 7?", "answer": "6 x 7 = 42\n#### 42"},
]
MATH = [
    {
        "problem": "Simplify $\\frac{2}{4}$.",
        "solution": "Divide: $\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Algebra",
    },
]


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def test_gsm8k_and_math_become_rows_the_run_reads_and_scores(in_repo, tiny_model, tmp_path):
    pq.write_table(pa.Table.from_pylist(GSM8K), str(tmp_path / "gsm8k.parquet"))
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MATH))
    assert _run("gsm8k", tmp_path / "gsm8k.parquet", tmp_path / "out/gsm8k.parquet", "--split", "test").returncode == 0
    assert _run("math", tmp_path / "math.jsonl", tmp_path / "out/math.jsonl").returncode == 0
    cfg = load_config(
        "configs/quickstart.yaml", ["data.answer_column=reward_model.ground_truth", "data.max_prompt_length=256"]
    )
    tok = load_tokenizer(cfg)
    ps = prompts_for(cfg, tok, [tmp_path / "out/gsm8k.parquet", tmp_path / "out/math.jsonl"])
    assert ps.answers == ["1203", "42", "\\frac{1}{2}"]
    assert ps.sources == ["openai/gsm8k"] * 2 + ["hendrycks/competition_math"]
    assert ps.extras[0]["split"] == "test" and ps.extras[2]["level"] == "Level 1"
    assert ps.messages[1][0]["content"].endswith('output the final answer after "####".')
    rule = get_reward("exact_match", extract="gsm8k")
    assert [rule(r, a, {}) for r, a in (("so 1203\n#### 1,203", "1203"), ("#### 41", "42"))] == [1.0, 0.0]
    assert get_reward("math_verify")("It is $\\boxed{0.5}$.", ps.answers[2], {}) == 1.0


def test_a_row_without_a_final_answer_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text(
        json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q", "answer": "4"}) + "\n"
    )
    res = _run("gsm8k", tmp_path / "bad.jsonl", tmp_path / "out.jsonl")
    assert res.returncode == 2 and "bad.jsonl: row 1: 'answer' has no final '#### <number>'" in res.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("recipe", ["gsm8k_grpo_qwen25_7b", "gsm8k_grpo_qwen25_1_5b"])
def test_the_gsm8k_recipes_validate_on_converted_data(in_repo, tmp_path, recipe):
    """configs/gsm8k_grpo_qwen25_{7b,1_5b}.yaml (one 8-GPU node, verl's GSM8K settings) pass
    ``validate`` once their data exist, converted by the tool."""
    from typer.testing import CliRunner

    from spmd_rl.cli import app

    pq.write_table(pa.Table.from_pylist(GSM8K), str(tmp_path / "gsm8k.parquet"))
    for split in ("train", "test"):
        assert (
            _run("gsm8k", tmp_path / "gsm8k.parquet", tmp_path / f"{split}.parquet", "--split", split).returncode == 0
        )
    over = [f"data.train_path=[{tmp_path}/train.parquet]", f"data.test_path={tmp_path}/test.parquet"]
    res = CliRunner().invoke(app, ["validate", f"configs/{recipe}.yaml", *over])
    assert res.exit_code == 0 and "grpo G=1024 N=5" in res.output, res.output
