"""The agent of ``rollout.agent``: a user's ``module:function``, or a command line.

A function is called as ``agent(base_url, api_key, row)`` in a thread of the rank's agent process
(``agent_host``), where ``row`` is the dataset row (``prompt``, ``messages``,
``answer``, ``data_source``, ``extra_info``). A command is started once per trajectory with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` in its environment (what the ``openai`` client reads)
and the row as one JSON line on its standard input; it is killed past
``rollout.gateway.agent_timeout_s``.

Either returns its reward contribution (a number; a command prints it as its last line), or
nothing: the reward rule then scores the policy's last turn, as it does for in-process
environments. Anything else, a raised exception, a non-zero exit or a timeout counts in
``agent_failures`` and contributes 0: the trajectory keeps what was sampled.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from collections.abc import Callable

from spmd_rl.catalog import is_command_line, user_function

AgentFn = Callable[[str, str, dict], object]


def load_agent(spec: str, timeout_s: float) -> AgentFn:
    if is_command_line(spec):
        return _command(shlex.split(spec), timeout_s)
    return user_function(spec, "rollout.agent")


def reward_of(result: object) -> float:
    """The agent's reward contribution: a finite number, or 0 for None; TypeError otherwise."""
    if result is None:
        return 0.0
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise TypeError(f"an agent returns a finite number or None, not {type(result).__name__} {result!r:.60}")
    return float(result)


def _command(argv: list[str], timeout_s: float) -> AgentFn:
    def run(base_url: str, api_key: str, row: dict) -> float | None:
        env = os.environ | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        out = subprocess.run(
            argv,
            input=json.dumps(row, default=str) + "\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited {out.returncode}: {out.stderr.strip()[-300:]}")
        lines = out.stdout.strip().splitlines()
        return float(lines[-1]) if lines else None

    return run
