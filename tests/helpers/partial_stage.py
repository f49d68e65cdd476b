"""The partial-rollout stage function (``trainer.stages.rollout``) on a real VllmRollout at
temperature 0, two iterations without a weight update in between: prints one JSON line with,
per sample, the response generated at once and the one carried from iteration 0 into
iteration 1, with its per-token versions. Run as a subprocess. Args: FOLDER BUDGET LIMIT."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spmd_rl.config.loader import load_config
from spmd_rl.distributed.accelerator import detect
from spmd_rl.dock.batch import DockBatch
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.recipe.graph import Modes
from spmd_rl.trainer.carry import Piece
from spmd_rl.trainer.stages import StageCall, stage_fn
from spmd_rl.trainer.stages.registry import StageView

folder, budget, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(
    Path("configs/quickstart.yaml"),
    [
        f"model.path={folder}",
        "rollout.temperature=0",
        "rollout.n=2",
        f"rollout.max_response_length={limit}",
        f"stream.partial_tokens={budget}",
        "actor.correction.tis_cap=2",
    ],
)
engine = VllmRollout.build(
    folder, detect("cpu"), cfg.rollout, tp=1, dtype="float32", max_model_len=128, seed=0, distributed=False
)
tok = AutoTokenizer.from_pretrained(folder)
rows = [json.loads(line) for line in (Path(folder) / "test.jsonl").read_text().splitlines()[:3]]
prompts = [
    tok(
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    for r in rows
]
view = StageView(cfg=cfg, modes=Modes.of(cfg), rollout=engine)  # single-turn


def call(it, pieces):
    cols = {
        "prompt_ids": [torch.tensor(prompts[k // 2], dtype=torch.int32) for k in range(len(pieces))],
        "prompt_row": [torch.tensor(k // 2) for k in range(len(pieces))],
    }
    for name in ("prefix_ids", "prefix_log_prob", "prefix_version", "prefix_done"):
        cols[name] = [p.columns()[name] for p in pieces]
    batch = DockBatch(
        torch.arange(len(pieces)), cols, frozenset({"prompt_ids", "prefix_ids", "prefix_log_prob", "prefix_version"})
    )
    return stage_fn("actor_rollout")(StageCall(view, it, None, batch, True, list(range(len(pieces)))))


first = call(0, [Piece(k // 2) for k in range(2 * len(prompts))])
second = call(1, [first.pieces[i] for i in range(2 * len(prompts))])
whole = engine.continue_samples([(p, limit) for p in prompts for _ in range(2)])
print(
    json.dumps(
        {
            "whole": [s.token_ids for s in whole],
            "after_0": [first.pieces[i].token_ids for i in sorted(first.pieces)],
            "carried": [v.tolist() for v in second.columns["response_ids"]],
            "versions": [v.tolist() for v in second.columns["response_version"]],
            "logprobs": [v.tolist() for v in second.columns["rollout_log_prob"]],
            "done": [second.pieces[i].done for i in sorted(second.pieces)],
        }
    )
)
