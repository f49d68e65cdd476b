"""The agents' own process: every agent of a rank runs here, not in the rank.

An agent is Python under the user's control (the ``openai`` client alone spends about 2 ms of CPU
per call on a 2-core EPYC); in the rank's process it would hold the interpreter lock the engine
loop needs, and an agent that crashes the interpreter (a segfault in a native library,
``os._exit``) would take the rank with it. So the rank starts one host per generation phase owner
(``AgentHost``): ``python -m spmd_rl.gateway.agent_host SPEC TIMEOUT CONCURRENCY``, which runs up
to CONCURRENCY agents at once in threads. They talk over the host's stdin and stdout in JSON
lines, never pickle:

- rank -> host: ``{"id": n, "base_url": ..., "api_key": ..., "row": {...}}``;
- host -> rank: ``{"id": n, "reward": float or null}`` or ``{"id": n, "error": "..."}``.

A host that exits fails every agent it was running (``agent_failures``); the next phase starts a
new one.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("spmd_rl")


class AgentHost:
    """The rank's side: ``submit`` one agent run, a future of its reward."""

    def __init__(self, spec: str, timeout_s: float, concurrency: int):
        self.argv = [sys.executable, "-m", "spmd_rl.gateway.agent_host", spec, str(timeout_s), str(concurrency)]
        self.proc: subprocess.Popen | None = None
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, args=(proc,), daemon=True, name="spmd-rl-agent-host").start()
        return proc

    def submit(self, base_url: str, api_key: str, row: dict) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            n = next(self._ids)
            self._waiting[n] = fut
            line = json.dumps({"id": n, "base_url": base_url, "api_key": api_key, "row": row}, default=str)
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except OSError as exc:  # the host died: the reader fails what it held
                self._waiting.pop(n, None)
                fut.set_exception(RuntimeError(f"the agent host is gone: {exc}"))
        return fut

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
                n = int(msg["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("the agent host wrote a line that is not its protocol: %.200s", line)
                continue
            with self._lock:
                fut = self._waiting.pop(n, None)
            if fut is None:
                continue
            if "error" in msg:
                fut.set_exception(RuntimeError(str(msg["error"])))
            else:
                fut.set_result(msg.get("reward"))
        code = proc.wait()
        with self._lock:
            lost, self._waiting = self._waiting, {}
        for fut in lost.values():
            fut.set_exception(RuntimeError(f"the agent host exited with code {code}"))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(spec: str, timeout_s: float, concurrency: int) -> None:
    """The host's side: run each agent asked for, answer with its reward or its error."""
    from spmd_rl.gateway.agents import load_agent, reward_of

    agent = load_agent(spec, timeout_s)
    out_lock = threading.Lock()
    protocol = os.fdopen(os.dup(1), "w")  # an agent's own prints go to stderr, never into the protocol
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(msg: dict) -> None:
        reply: dict = {"id": msg["id"]}
        try:
            reply["reward"] = reward_of(agent(msg["base_url"], msg["api_key"], msg["row"]))
        except BaseException as exc:  # noqa: BLE001 - the agent's failure is its trajectory's, not the host's
            reply["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        with out_lock:
            protocol.write(json.dumps(reply) + "\n")
            protocol.flush()

    with ThreadPoolExecutor(concurrency, thread_name_prefix="spmd-rl-agent") as pool:
        for line in sys.stdin:
            pool.submit(answer, json.loads(line))


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
