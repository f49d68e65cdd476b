"""The data, tokenizer, sampler and device fields reach what reads them, through the same
helpers ``spmd_rl.train`` builds its run with."""

from __future__ import annotations

import json
import logging
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
    with pytest.raises(ValueError, match="missing field 'prompt'"):
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


def _verl_rows():
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them (its parquet layout)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": k, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"},
        }
        for k, (a, b) in enumerate([(3, 4), (10, 32), (5, 5)])
    ]


def test_verls_parquet_layout_is_read_as_it_is(in_repo, tiny_model, tmp_path):
    """A message-list prompt, the answer at reward_model.ground_truth, data_source and
    extra_info carried, the system prompt put first, chat_template_kwargs handed to the
    template: each prompt's ids are the template's rendering of exactly those messages, and no
    Python repr of a list reaches a prompt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), str(path))
    over = ["data.answer_column=reward_model.ground_truth", "data.system_prompt='Answer after ####.'"]
    cfg = _cfg(*over, "data.chat_template_kwargs={enable_thinking: false}", "data.max_prompt_length=128")
    tok = load_tokenizer(cfg)
    ps = prompts_for(cfg, tok, [path, path])  # two train files: one dataset, rows numbered over both
    assert ps.answers == ["7", "42", "10"] * 2 and ps.rows == list(range(6))
    assert ps.sources == ["openai/gsm8k"] * 6 and ps.extras[1]["answer"].endswith("#### 42")
    want = [{"role": "system", "content": "Answer after ####."}, _verl_rows()[1]["prompt"][0]]
    assert ps.messages[1] == want and ps.info(1)["prompt"] == want and ps.info(1)["data_source"] == "openai/gsm8k"
    rendered = tok.apply_chat_template(want, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert ps.prompt_ids[1] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert "'role'" not in tok.decode(ps.prompt_ids[1]) and "Answer after ####." in tok.decode(ps.prompt_ids[1])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ flavour }}"
    flavoured = _cfg(*over, "data.max_prompt_length=128", "data.chat_template_kwargs={flavour: mint}")
    assert tok.decode(prompts_for(flavoured, tok, path).prompt_ids[0]).endswith("step by step.\nmint")
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    rows = [{"prompt": own_system, "reward_model": {"ground_truth": 2}}]
    (tmp_path / "own.jsonl").write_text(json.dumps(rows[0]) + "\n")
    kept = prompts_for(cfg, tok, tmp_path / "own.jsonl")
    assert kept.messages == [own_system] and kept.answers == ["2"]  # the row's system message stays first


@pytest.mark.parametrize(
    "row,field,problem",
    [
        ({"prompt": [{"content": "hi"}], "answer": "1"}, "prompt[0]", "has no role"),
        ({"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}, "prompt[0]", "has role 'robot'"),
        ({"prompt": [{"role": "user", "content": ["hi"]}], "answer": "1"}, "prompt[0].content", "is a list"),
        ({"prompt": {"text": "hi"}, "answer": "1"}, "prompt", "holds a dict"),
        ({"prompt": "hi", "answer": {"value": 1}}, "answer", "holds a dict, not text"),
        ({"prompt": [], "answer": "1"}, "prompt", "is an empty message list"),
    ],
)
def test_a_row_that_does_not_fit_is_refused_naming_the_file_row_and_field(
    in_repo, tiny_model, tmp_path, row, field, problem
):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "answer": "1"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as err:
        prompts_for(_cfg(), load_tokenizer(_cfg()), path)
    assert f"{path}: row 1, field {field!r}: {problem}" in str(err.value), str(err.value)


def test_messages_without_a_template_and_missing_nested_fields(in_repo, tiny_model, tmp_path, caplog):
    """A conversation cannot be bare text (refused, naming the fix); a row without the nested
    answer is skipped and counted, naming the path."""
    path = tmp_path / "p.jsonl"
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    path.write_text(json.dumps({"prompt": two, "reward_model": {"ground_truth": "1"}}) + "\n")
    plain = _cfg("data.apply_chat_template=false", "data.answer_column=reward_model.ground_truth")
    with pytest.raises(ValueError, match="holds 3 messages; set data.apply_chat_template: true"):
        prompts_for(plain, load_tokenizer(plain), path)
    path.write_text(
        json.dumps({"prompt": "x", "reward_model": {"style": "rule"}})
        + "\n"
        + json.dumps({"prompt": "y", "reward_model": {"ground_truth": 3}})
        + "\n"
    )
    nested = _cfg("data.answer_column=reward_model.ground_truth")
    with caplog.at_level(logging.WARNING):
        ps = prompts_for(nested, load_tokenizer(nested), path)
    assert ps.answers == ["3"] and ps.skipped == {"missing field 'reward_model.ground_truth'": [0]}


def test_a_tokenizer_without_a_pad_token_pads_with_eos(in_repo, tiny_model, tmp_path):
    """Llama 3's tokenizers have no pad token: the run pads with EOS (padding is masked
    wherever it is read) instead of failing at the first batch."""
    from transformers import AutoTokenizer

    from spmd_rl.engines.training.logprobs import build_batch

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").pad_token_id is None
    cfg = _cfg(f"model.tokenizer_path={tmp_path / 'tok'}")
    loaded = load_tokenizer(cfg)
    assert loaded.pad_token_id == loaded.eos_token_id is not None
    batch = build_batch(
        [torch.tensor([5, 6, 7]), torch.tensor([8])], [torch.tensor([9]), torch.tensor([10, 11])], loaded.pad_token_id
    )
    assert batch.attention_mask.sum().item() == 7


def test_source_and_extra_fields_are_read_where_the_config_says(in_repo, tiny_model, tmp_path):
    """``data.data_source_column`` and ``data.extra_info_column`` are dotted paths too; a row
    without them gets "" and {} (a reward still gets both keys)."""
    path = tmp_path / "p.jsonl"
    rows = [{"q": "1+1=", "a": 2, "meta": {"src": "arith", "more": {"k": 1}}}, {"q": "2+2=", "a": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = ["data.prompt_column=q", "data.answer_column=a"]
    cfg = _cfg(*over, "data.data_source_column=meta.src", "data.extra_info_column=meta.more")
    ps = prompts_for(cfg, load_tokenizer(cfg), path)
    assert (ps.sources, ps.extras) == (["arith", ""], [{"k": 1}, {}])
    assert ps.info(1) == {"prompt": [{"role": "user", "content": "2+2="}], "data_source": "", "extra_info": {}}
    assert prompts_for(_cfg(*over), load_tokenizer(cfg), path).sources == ["", ""]  # the default paths: absent
