"""Greedy one-prompt generation from a model folder through in-process vLLM and through HF;
prints one JSON line with both token-id lists (run as a subprocess: vLLM changes process state)."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

folder, prompt = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(folder)
ids = tok.apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
)
llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[
    0
].outputs[0]
hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, len(ids) :]
print(json.dumps({"vllm": list(out.token_ids), "hf": ref.tolist(), "text": out.text, "eos": tok.eos_token_id}))
