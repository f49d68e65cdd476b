"""Multi-turn rollouts (``envs.multi_turn``) on a real in-process vLLM and the tiny model,
float32. Prints one JSON line of what each check observed; ``tests/integration/test_multi_turn.py``
asserts on it. Args: FOLDER PORT (a loopback TCP server the test runs, which model-written
code must not reach)."""

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rl.algos.policy_loss import ClipConfig, LossNorm, get_policy_loss
from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.training.logprobs import build_batch, lm_response_logprobs, logit_window
from spmd_rl.engines.vllm.engine import VllmRollout
from spmd_rl.engines.vllm.logs import quiet_vllm
from spmd_rl.envs.base import Step, Turn
from spmd_rl.envs.multi_turn import MultiTurnRollout, TurnLimits
from spmd_rl.envs.python_tool import PythonTool

REWRITING = (  # renders every earlier assistant turn with an "X" in front: it rewrites history
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\nX' + message['content'] + "
    "'<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Echo:
    """Two tool turns ("ok 1", "ok 2", each a little later than the last), then done."""

    def __init__(self, row):
        self.n = 0

    def step(self, turn):
        self.n += 1
        if self.n > 2:
            return Step(done=True, reward=0.25)
        time.sleep(0.02 * self.n)
        return Step(observation=f"ok {self.n}", reward=0.5, metadata={"tool_calls": 1})


class Forever:
    def __init__(self, row):
        pass

    def step(self, turn):
        return Step(observation="again", metadata={"tool_calls": 1})


class HangsOnce:
    def __init__(self, row):
        self.first = True

    def step(self, turn):
        if self.first:
            self.first = False
            time.sleep(20)
        return Step(done=True)


class Raises:
    def __init__(self, row):
        self.first = True

    def step(self, turn):
        if self.first:
            self.first = False
            raise RuntimeError("the environment broke")
        return Step(done=True)


def code_runner(port: int):
    codes = {
        "hang": "while True:\n    pass\n",
        "crash": "import os\nos.abort()\n",
        "flood": "print('x' * (10 * 2**20))\n",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
        f"timeout=2).sendall(b'hi')\nprint('reached')\n",
    }

    class ScriptedPython:
        """Turn 1 runs the row's code in the python tool's sandbox; turn 2 ends."""

        def __init__(self, row):
            self.code, self.tool, self.n = codes[row["kind"]], PythonTool(row), 0

        def step(self, turn):
            self.n += 1
            if self.n > 1:
                return Step(done=True)
            return self.tool.step(Turn(f"```python\n{self.code}```", ()))

    return ScriptedPython, list(codes)


def run(engine, tok, factory, items, limits, **kw):
    return MultiTurnRollout(engine, tok, factory, limits, **kw).run(
        items, **({"seed": 7} | {k: v for k, v in kw.items() if k == "temperature"})
    )


def describe(t):
    return {
        "ids": t.ids,
        "mask": t.mask,
        "logprobs": t.logprobs,
        "stats": dict(t.stats),
        "reward": t.reward,
        "text": t.last_text,
    }


def main():  # noqa: PLR0915
    folder, port = sys.argv[1], int(sys.argv[2])
    quiet_vllm(None, 0)
    tok = AutoTokenizer.from_pretrained(folder)
    engine = VllmRollout.build(
        folder,
        detect("cpu"),
        RolloutConfig(n=1, max_response_length=96),
        tp=1,
        dtype="float32",
        max_model_len=160,
        seed=0,
        distributed=False,
    )
    rows = [json.loads(line) for line in open(f"{folder}/test.jsonl")][:6]
    items = [
        (
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            r,
        )
        for r in rows
    ]
    out = {}

    echo = TurnLimits(max_turns=4, max_tokens=96, tool_timeout_s=5.0)
    cont = run(engine, tok, Echo, items, echo)
    lock = MultiTurnRollout(engine, tok, Echo, echo, lockstep=True).run(items, seed=7)
    out["echo"] = [describe(t) for t in cont]
    out["echo_lockstep_same"] = [a.ids == b.ids and a.mask == b.mask for a, b in zip(cont, lock)]
    out["echo_text"] = tok.decode(cont[0].prompt + cont[0].ids)

    # the trainer's log-probs of the same tokens, from an HF forward, against vLLM's
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = [torch.tensor(t.prompt) for t in cont]
    batch = build_batch(
        prompts, [torch.tensor(t.ids) for t in cont], tok.pad_token_id, sampled=[torch.tensor(t.mask) for t in cont]
    )
    with torch.no_grad():
        lp, _ = lm_response_logprobs(hf, batch)
    diffs, masked_zero = [], []
    for k, t in enumerate(cont):
        m = torch.tensor(t.mask, dtype=torch.bool)
        diffs.append(float((lp[k, : m.numel()][m] - torch.tensor(t.logprobs)[m]).abs().max()))
        masked_zero.append(
            bool((lp[k, : m.numel()][~m] == 0).all()) and bool((torch.tensor(t.logprobs)[~m] == 0).all())
        )
    out["hf_vs_vllm_max_abs"] = max(diffs)
    out["inserted_logprobs_zero"] = masked_zero

    # inserted tokens in the loss: the gradient reaching their logits, and a changed inserted tail
    t = cont[0]
    tail_a, tail_b = (
        tok.encode("\ntail one", add_special_tokens=False),
        tok.encode("\nother!!!", add_special_tokens=False),
    )
    grads, logit_grads = [], []
    for tail in (tail_a, tail_b):
        hf.zero_grad()
        ids, mask = t.ids + tail, t.mask + [0] * len(tail)
        b = build_batch([prompts[0]], [torch.tensor(ids)], tok.pad_token_id, sampled=[torch.tensor(mask)])
        seen = []

        def keep(_module, _inputs, logits):
            logits.retain_grad()
            seen.append(logits)

        hook = hf.lm_head.register_forward_hook(keep)
        lp, _ = lm_response_logprobs(hf, b)
        hook.remove()
        old = torch.tensor(t.logprobs + [0.0] * len(tail))[None] - 0.1  # some ratio away from 1
        loss = get_policy_loss("vanilla")(
            lp, old, torch.ones(1), b.mask, ClipConfig(0.2, 0.28, 3.0, "token-mean"), LossNorm(float(b.mask.sum()), 1.0)
        ).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in hf.parameters()]).clone())
        # positions whose logits predict an inserted token (response token j is predicted at P + j - 1)
        lo, hi = logit_window(b)
        inserted = [
            len(t.prompt) + j - 1 - lo for j, m in enumerate(mask) if not m and lo <= len(t.prompt) + j - 1 < hi
        ]
        logit_grads.append(float(seen[0].grad[0, inserted].abs().max()))
        out["inserted_logits_checked"] = len(inserted)
        out.setdefault("tail_loss", []).append(loss.item())
    out["tail_grads_equal"] = bool(torch.equal(grads[0], grads[1]))
    out["inserted_logit_grad_max"] = max(logit_grads)

    forever = run(engine, tok, Forever, items[:3], TurnLimits(max_turns=3, max_tokens=96, tool_timeout_s=5.0))
    out["forever"] = [dict(t.stats) for t in forever]

    hung = run(engine, tok, HangsOnce, items[:3], TurnLimits(max_turns=4, max_tokens=96, tool_timeout_s=1.0))
    out["hang"] = [describe(t) | {"full": tok.decode(t.ids)} for t in hung]
    raised = run(engine, tok, Raises, items[:2], TurnLimits(max_turns=4, max_tokens=96, tool_timeout_s=5.0))
    out["raises"] = [describe(t) | {"full": tok.decode(t.ids)} for t in raised]

    runner, kinds = code_runner(port)
    code_items = [(items[k][0], {"prompt": items[k][1]["prompt"], "kind": kind}) for k, kind in enumerate(kinds)]
    coded = run(engine, tok, runner, code_items, TurnLimits(max_turns=4, max_tokens=96, tool_timeout_s=30.0))
    out["code"] = {kind: describe(t) | {"full": tok.decode(t.ids)} for kind, t in zip(kinds, coded)}

    rewriting = AutoTokenizer.from_pretrained(folder)
    rewriting.chat_template = REWRITING
    broken = run(engine, rewriting, Echo, items[:3], echo)
    out["prefix_break"] = [describe(t) for t in broken]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
