"""Shared fixtures: the tiny model folder (built by launch/setup.sh, or here on demand); the
order in which the pytest-xdist workers get the test files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.launcher import preload
from tests.preload_servers import PreloadServers

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "tiny-qwen2"
TINY_TOOLS = REPO / "assets" / "tiny-tools"
TINY_AGENT = REPO / "assets" / "tiny-agent"
TINY_MOE = REPO / "assets" / "tiny-qwen3-moe"
FILE_SECONDS = REPO / "tests" / "file_seconds.json"
FAULTS = REPO / "tests" / "helpers" / "faults"
"""The fault-injection ``sitecustomize`` (inert unless ``SPMD_RL_TEST_FAULTS`` holds a plan):
on every subprocess's path, so a run with a plan differs from the preload servers only in that
per-run variable and forks from them like any other."""


def pytest_collection_modifyitems(config, items):
    """Longest file first (``tests/file_seconds.json``, written by ``tools/test_seconds.py``):
    ``--dist loadfile`` hands whole files to the workers in collection order, so with the long
    ones first the last to finish is a short one and the workers end together. Each file's
    tests keep their order and stay together (module fixtures are set up once); files with no
    record go last."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(item.path.relative_to(REPO).as_posix(), 0.0))


@pytest.fixture(scope="module")
def etcd():
    """A real etcd process on loopback for the tests of one module."""
    from spmd_rl.dock.etcd_server import EmbeddedEtcd

    with EmbeddedEtcd() as e:
        yield e


@pytest.fixture(scope="module")
def world_of_one():
    """A world-1 gloo process group in this process, for stages and engines whose
    collectives must run without torchrun."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    yield
    dist.destroy_process_group()


def _materialized(*names: str) -> None:
    """The named assets under ``assets/``, built from the committed weights where missing or
    stale (``tools/tiny_weights.py``; the setup normally built them, and then this checks only)."""
    subprocess.run([sys.executable, str(REPO / "tools" / "tiny_weights.py"), "materialize", *names], check=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The warm-started tiny model + data (the preference pairs too)."""
    _materialized("tiny-qwen2")
    return TINY


@pytest.fixture(scope="session")
def tiny_tools() -> Path:
    """The tiny tool-using model and its "a*b=" task (configs/quickstart_tools.yaml)."""
    _materialized("tiny-tools")
    return TINY_TOOLS


@pytest.fixture(scope="session")
def tiny_agent() -> Path:
    """The tiny tool model whose calls are Hermes tool calls (configs/quickstart_agent.yaml)."""
    _materialized("tiny-agent")
    return TINY_AGENT


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """The tiny model's Qwen3-MoE sibling (same task and tokenizer)."""
    _materialized("tiny-qwen3-moe")
    return TINY_MOE


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model) -> Path:
    """The tiny reward model (a sequence classifier on the tiny policy's trunk)."""
    _materialized("tiny-qwen2-reward")
    return tiny_model / "reward_model"


@pytest.fixture
def in_repo(monkeypatch):
    """Run with the repository root as the current directory (configs use relative paths)."""
    monkeypatch.chdir(REPO)
    return REPO


TEST_OWNER = "SPMD_RL_TEST_OWNER"
"""Every process the tests start carries ``TEST_OWNER=<pytest's pid>`` (``torchrun_util.OwnShm``
finds the test's own processes by it, never another job's)."""


LIBRARY_SET = ("GOMP_CPU_AFFINITY", "LD_LIBRARY_PATH", "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4")
"""Variables vLLM sets in this process when a test runs it in-process (its import, an engine
config, the CPU worker's OpenMP binding). A test's subprocesses get them as the session began,
as they would were the test module run alone, and as the preload servers' ranks must."""
_SESSION_ENV = dict(os.environ)  # conftest is imported before any test imports vLLM


def subprocess_env() -> dict[str, str]:
    """The environment of every process a test starts: this one's (but ``LIBRARY_SET`` as the
    session began), its owner mark, the repository and the fault plans (``FAULTS``) on the path,
    the preload servers' sockets (``preload_server``), and this interpreter as ``PYTHON``."""
    env = dict(os.environ) | {TEST_OWNER: str(os.getpid())}
    for name in LIBRARY_SET:
        if name in _SESSION_ENV:
            env[name] = _SESSION_ENV[name]
        else:
            env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(FAULTS), env.get("PYTHONPATH", "")])
    env["PYTHON"] = sys.executable  # what launch/*.sh run (their default is python3 on PATH)
    if _PRELOAD.sockets:
        env[preload.ENV] = _PRELOAD.env_value
    return env


_PRELOAD = PreloadServers()


@pytest.fixture(scope="session", autouse=True)
def preload_server(request):
    """The session's preload servers (tests/preload_servers.py), started before the first test
    where a test marked slow (they start ranks) is selected."""
    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield _PRELOAD
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # sets TORCHINDUCTOR_CACHE_DIR to its default now, not later in a test that compiles in-process
    _PRELOAD.start(subprocess_env(), REPO)  # the environment before any test changes it: a rank's must equal it
    yield _PRELOAD
    summary = _PRELOAD.stop()
    if summary:
        _PRELOAD_SUMMARIES.append(summary)
        if hasattr(request.config, "workeroutput"):  # a pytest-xdist worker: the controller prints it
            request.config.workeroutput["preload"] = summary


_PRELOAD_SUMMARIES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def no_environment_drift():
    """What in-process library code (vLLM, inductor) adds to this process's environment stays
    with the module that ran it: later modules' subprocesses start from the session's
    environment, so their ranks stay the preload servers' equals."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_testnodedown(node, error):
    if "preload" in getattr(node, "workeroutput", {}):
        _PRELOAD_SUMMARIES.append(node.workeroutput["preload"])


def pytest_terminal_summary(terminalreporter):
    for summary in _PRELOAD_SUMMARIES:
        terminalreporter.write_line(f"preload server: {summary}")


def run_helper(script: str, *args: object, timeout: float = 300) -> dict:
    """Run ``tests/helpers/<script>`` in its own process (vLLM changes process state) and return
    the JSON object on its last stdout line that holds one (vLLM may log to stdout at exit)."""
    import json

    out = subprocess.run(
        [sys.executable, str(REPO / "tests/helpers" / script), *map(str, args)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
