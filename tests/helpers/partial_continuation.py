"""Greedy responses of a model folder (its first test prompts and one of random ids) through the project's
VllmRollout, generated at once
and continued in pieces of BUDGET tokens (partial rollout's primitive, no weight change in
between); prints one JSON line. Run as a subprocess (vLLM changes process state).
Args: FOLDER BUDGET MAX_TOKENS."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.vllm.engine import VllmRollout

folder, budget, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = RolloutConfig(n=1, max_response_length=limit, temperature=0.0)
engine = VllmRollout.build(
    folder, detect("cpu"), cfg, tp=1, dtype="float32", max_model_len=128, seed=0, distributed=False
)
tok = AutoTokenizer.from_pretrained(folder)
rows = [json.loads(line) for line in (Path(folder) / "test.jsonl").read_text().splitlines()[:6]]
texts = [
    tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
    for r in rows
]
prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts] + [[5, 17, 33, 9, 41]]
whole = engine.continue_samples([(p, limit) for p in prompts])
pieces = [{"ids": [], "logprobs": [], "stopped": False, "pieces": 0} for _ in prompts]
while open_ := [k for k, r in enumerate(pieces) if not r["stopped"] and len(r["ids"]) < limit]:
    got = engine.continue_samples(
        [(prompts[k] + pieces[k]["ids"], min(budget, limit - len(pieces[k]["ids"]))) for k in open_]
    )
    for k, s in zip(open_, got):
        pieces[k]["ids"] += s.token_ids
        pieces[k]["logprobs"] += s.logprobs
        pieces[k]["stopped"] = s.stopped
        pieces[k]["pieces"] += 1
print(
    json.dumps(
        {"whole": [{"ids": s.token_ids, "logprobs": s.logprobs, "stopped": s.stopped} for s in whole], "pieces": pieces}
    )
)
