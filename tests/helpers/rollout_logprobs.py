"""Sample from a model folder through the project's RolloutEngine (single process) and print
one JSON line: the prompt ids, and per sample the token ids and the rollout log-probs
(run as a subprocess: vLLM changes process state). Args: FOLDER TEMPERATURE."""

import json
import sys

from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.rollout import RolloutEngine

folder, temperature = sys.argv[1], float(sys.argv[2])
cfg = RolloutConfig(n=4, max_response_length=8, temperature=temperature)
engine = RolloutEngine(folder, detect("cpu"), cfg, tp=1, dtype="float32", max_model_len=64, seed=0, distributed=False)
prompt = [5, 17, 33, 9, 41]
samples = engine.generate([prompt], n=4, max_tokens=8, seed=1)
print(json.dumps({"prompt": prompt, "samples": [{"ids": s.token_ids, "logprobs": s.logprobs} for s in samples]}))
