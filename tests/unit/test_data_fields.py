"""The data, tokenizer, sampler and device fields reach what reads them, through the same
helpers ``spmd_rl.train`` builds its run with."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spmd_rl.config.loader import load_config
from spmd_rl.data.prompts import load_tokenizer, prompts_for
from spmd_rl.data.sampler import sampler_for
from spmd_rl.distributed.accelerator import detect
from tests.conftest import REPO


def _cfg(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def test_columns_and_chat_template(in_repo, tiny_model, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"q": "12+30=", "a": "42"}) + "\n" + json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    tok = load_tokenizer(_cfg())
    chat = prompts_for(_cfg("data.prompt_column=q", "data.answer_column=a"), tok, data)
    assert chat.answers == ["42", "2"]
    assert chat.prompt_ids[0] == list(
        tok.apply_chat_template(
            [{"role": "user", "content": "12+30="}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    plain = prompts_for(
        _cfg("data.prompt_column=q", "data.answer_column=a", "data.apply_chat_template=false"), tok, data
    )
    assert plain.prompt_ids[0] == tok.encode("12+30=", add_special_tokens=False) != chat.prompt_ids[0]
    with pytest.raises(ValueError, match="missing column 'prompt'"):
        prompts_for(_cfg(), tok, data)  # the default column is not in this file


def test_tokenizer_path(in_repo, tiny_model, tmp_path):
    copy = tmp_path / "tok"
    copy.mkdir()
    for f in tiny_model.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, copy / f.name)
    assert load_tokenizer(_cfg(f"model.tokenizer_path={copy}")).name_or_path == str(copy)
    assert load_tokenizer(_cfg()).name_or_path == "assets/tiny-qwen2"


def test_shuffle_and_seed_set_the_prompt_order():
    order = lambda *o: sampler_for(_cfg(*o), 50).next_batch(10)  # noqa: E731
    assert order("data.shuffle=false") == list(range(10))
    assert order("trainer.seed=0") == order("trainer.seed=0") != order("trainer.seed=1")
    assert sorted(order("trainer.seed=0")) != list(range(10))


def test_device_field():
    assert detect("cpu").kind == "cpu"
    if torch.cuda.is_available():
        assert detect("cuda").kind == "cuda"
    else:
        with pytest.raises(ValueError, match="trainer.device=cuda: no CUDA device"):
            detect("cuda")
