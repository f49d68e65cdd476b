"""tools/make_gpu_model.py and configs/gpu_qwen25_1_5b.yaml: the GPU case's tokenizer, prompts
and weights come out as the config needs them, checked on a scaled-down build (a 2 MiB corpus,
1,500 trained tokens, two layers); the full architecture is checked by its parameter count."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_gpu_model  # noqa: E402

SMALL = ["--vocab", "1500", "--corpus-mib", "2", "--train", "48", "--test", "16", "--max-tokens", "200"]
SETS = ["vocab_size=2048", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-model") / "m"
    make_gpu_model.main(["--out", str(out), *SMALL, *[a for s in SETS for a in ("--set", s)]])
    make_gpu_model.main(["--out", str(out), "--weights", "--seed", "3"])
    return out


def test_the_tokenizer_has_the_trained_size_and_qwens_chat_tokens(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == 1503
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [1500, 1501, 1502]
    text = "def f(x):\n    return x + 1  # ünïcode\n"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok(text).input_ids) < len(text.encode())  # merges were learned, not bytes alone
    cfg = json.loads((built / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (1502, 1500)


def test_prompts_fit_the_length_window_with_the_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    rows = [json.loads(line) for name in ("train", "test") for line in (built / f"{name}.jsonl").open()]
    assert len(rows) == 64
    lengths = []
    for row in rows:
        chat = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        lengths.append(len(tok(chat, add_special_tokens=False).input_ids))
        a, b = row["prompt"].rsplit("What is ", 1)[1].rstrip("?").split("+")
        assert int(row["answer"]) == int(a) + int(b)
    assert 64 <= min(lengths) and max(lengths) <= 200 and max(lengths) - min(lengths) > 50


def test_the_weights_are_seeded_bf16_and_load_in_transformers(built, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == 2 and model.get_input_embeddings().weight.shape == (2048, 64)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.json").write_text((built / "config.json").read_text())
    make_gpu_model.main(["--out", str(again), "--weights", "--seed", "3"])
    twin = AutoModelForCausalLM.from_pretrained(again, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_the_config_validates_on_the_built_folder_and_plans_qwen25_1_5b(built):
    paths = [f"model.path={built}", f"data.train_path={built}/train.jsonl", f"data.test_path={built}/test.jsonl"]
    res = CliRunner().invoke(app, ["validate", str(REPO / "configs/gpu_qwen25_1_5b.yaml"), *paths])
    assert res.exit_code == 0, res.output
    cfg = load_config(REPO / "configs/gpu_qwen25_1_5b.yaml")
    assert (cfg.data.global_batch_size * cfg.rollout.n, cfg.data.max_prompt_length) == (256, 256)
    assert (cfg.rollout.max_response_length, cfg.model.dtype, cfg.reshard.mode) == (1024, "bfloat16", "allgather_swap")
    # Qwen2.5-1.5B has 1.54 B parameters (its model card: 1.54 B, 1.31 B without embeddings)
    arch = ModelArch.from_folder(REPO / "configs/models/qwen2.5-1.5b")
    assert abs(arch.num_params() / 1e9 - 1.54) < 0.01
    assert abs((arch.num_params() - 151936 * 1536) / 1e9 - 1.31) < 0.01
