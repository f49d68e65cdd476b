"""The built-in ``python`` environment: a policy turn holding a fenced python block runs it in
the sandbox (``envs.sandbox``: a jail, and CPU, memory, process, file, wall-time, output and
network limits; memory and tasks for the call as a whole where the node lets a cgroup be made,
else per process: ``spmd-rl doctor`` says which) and gets its output back as the tool turn; a
turn without a block ends the trajectory. A timeout, crash or flood is reported in the
observation and the metadata, and the trajectory goes on."""

from __future__ import annotations

import re
from dataclasses import replace

from spmd_rl.envs.base import EnvironmentFactory, Step, Turn, register_environment
from spmd_rl.envs.sandbox import Limits, run_python

BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


class PythonTool:
    limits = Limits(wall_s=5.0, cpu_s=5, memory_bytes=512 * 2**20, output_bytes=4096)

    def __init__(self, row: dict, limits: Limits | None = None):
        self.row = row
        self.limits = limits or PythonTool.limits

    def step(self, turn: Turn) -> Step:
        blocks = BLOCK.findall(turn.text)
        if not blocks:
            return Step(done=True)
        out = run_python(blocks[-1], self.limits)
        meta = {
            "tool_calls": 1,
            "tool_errors": int(out.status in ("error", "killed", "output_limit")),
            "tool_timeouts": int(out.status == "timeout"),
        }
        note = "" if out.ok else f"\n[{out.status}]"
        return Step(observation=out.output + note, metadata=meta)


register_environment("python")(PythonTool)


def factory(jail: bool) -> EnvironmentFactory:
    """The environment with its jail on, or off (``rollout.unsafe_python_without_jail``)."""
    limits = replace(PythonTool.limits, jail=jail)
    return lambda row: PythonTool(row, limits)
