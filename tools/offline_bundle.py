#!/usr/bin/env python
"""Make an offline install bundle for an air-gapped node: resolve what the node lacks for a
target (its Python, platform and installed packages), download those wheels only, and write
them as parts of at most ``--part-mib`` MiB with a manifest and a sha256 per chunk.

    # on the node (standard library only), carried out:
    python3 launch/offline_install.py describe > node.json
    # here, where an index is reachable:
    python tools/offline_bundle.py --node node.json --extra cuda --out bundle --part-mib 60
    # carry bundle/part-001 ... to the node, then there:
    bash part-001/install_offline.sh install . --target /opt/spmd-rl-site

Without a ``describe`` file: ``--python-version 3.12 --platform manylinux_2_39_x86_64
--freeze freeze.txt`` (the node's ``pip freeze``).

How it resolves (invariant: the bundle plus the node's own packages is one consistent set, and
nothing the node has is bundled):

- every distribution the node has is a constraint at its public version (``torch 2.11.0+cu130``
  -> ``torch==2.11.0``): the resolver keeps what the node has and picks the releases that fit
  it, e.g. the vLLM release that pins the node's torch;
- ``uv pip compile`` resolves for the target (``--python-version``, ``--python-platform``
  ``<machine>-manylinux_<glibc>``) from package metadata, without downloading a wheel: pip's own
  ``--dry-run`` downloads every wheel it resolves, torch's 900 MB included;
- ``pip download --no-deps`` fetches exactly the resolved releases the node lacks, for every
  manylinux tag the node's glibc accepts (pip matches ``--platform`` exactly and does not widen
  ``manylinux_2_39`` to the older tags, so they are listed);
- ``--build NAME`` takes a package that has no wheel from its source release and builds the
  wheel here; only a pure-Python result (``py3-none-any``) is accepted (python-etcd, which
  torchrun's etcd-v2 rendezvous needs, is released as source only);
- a file larger than a part is cut into chunks; chunks are packed into parts largest first;
- ``--exclude PATTERN`` leaves out resolved packages the node's programs never import (vLLM
  0.26.0 brings both CUDA 12 and CUDA 13 CUTLASS DSL libraries, 84 MiB each, and a video codec);
  the manifest lists them, and the installer's ``--no-deps`` install does not miss them.

The node's half, ``launch/offline_install.py``, and ``launch/install_offline.sh`` travel in every
part; its docstring gives the manifest's format. ``--index-url``/``--extra-index-url``/
``--find-links``/``--no-index`` go to both uv and pip (a mirror, or a folder of wheels).
Needs ``uv`` (installed by ``launch/setup.sh``, or ``pip install uv``).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
# the node's half: the manifest's format, name normalisation and the user-error type are its own
from offline_install import FORMAT, BundleError, canonical  # noqa: E402

NODE_FILES = (REPO / "launch" / "offline_install.py", REPO / "launch" / "install_offline.sh")
UV_MANYLINUX = (17, 40)
"""The manylinux_2_N range uv's ``--python-platform`` names (uv 0.13: x86_64-manylinux_2_17 ... _2_40)."""
PROJECT_LEFT_OUT = (".git", ".venv", "assets", "runs", "build", "*.egg-info", "__pycache__")
"""What ``--extra`` does not copy of the project before building its wheel (none of it is packaged)."""
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def parse_freeze(text: str) -> dict[str, str | None]:
    """``pip freeze`` lines -> name -> version; ``name @ url`` and ``-e`` lines give None (the node
    has it at a version no index names: it is kept, unconstrained)."""
    found: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-e"):
            egg = re.search(r"#egg=([A-Za-z0-9_.-]+)", raw)
            if egg:
                found[canonical(egg.group(1))] = None
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*(==\s*(\S+)|@\s*\S+)", line)
        if not m:
            raise BundleError(f"freeze line {raw!r}: expected `name==version` or `name @ url` (pip freeze's output)")
        found[canonical(m.group(1))] = m.group(3)
    return found


def node_from_args(args: argparse.Namespace) -> dict:
    """The target: a ``describe`` file, or --python-version/--platform/--freeze."""
    if args.node:
        node = json.loads(Path(args.node).read_text())
        missing = [k for k in ("python", "machine", "glibc", "installed") if k not in node]
        if missing:
            raise BundleError(f"{args.node}: no {', '.join(missing)}: write it with `offline_install.py describe`")
        return node
    if not (args.python_version and args.platform):
        raise BundleError("name the target: --node node.json, or --python-version and --platform (and --freeze)")
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", args.platform)
    if not m:
        raise BundleError(f"--platform {args.platform}: expected manylinux_2_N_<machine>, e.g. manylinux_2_39_x86_64")
    freeze = parse_freeze(Path(args.freeze).read_text()) if args.freeze else {}
    return {"python": args.python_version, "machine": m.group(2), "glibc": f"2.{m.group(1)}", "installed": freeze}


def glibc_minor(node: dict) -> int:
    m = re.fullmatch(r"2\.(\d+)", node["glibc"] or "")
    if not m:
        raise BundleError(f"node glibc {node['glibc']!r}: this tool makes bundles for glibc (manylinux) nodes only")
    return int(m.group(1))


def pip_platforms(node: dict) -> list[str]:
    """Every platform tag a wheel for this node may carry, newest first."""
    minor, machine = glibc_minor(node), node["machine"]
    tags = []
    for n in range(minor, 4, -1):
        tags.append(f"manylinux_2_{n}_{machine}")
        if n in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[n]}_{machine}")
    return tags


def uv_platform(node: dict) -> str:
    minor = glibc_minor(node)
    if minor < UV_MANYLINUX[0]:
        raise BundleError(f"node glibc 2.{minor}: older than manylinux_2_{UV_MANYLINUX[0]}, the oldest uv resolves for")
    return f"{node['machine']}-manylinux_2_{min(minor, UV_MANYLINUX[1])}"


def public(version: str) -> str:
    return version.split("+", 1)[0]


def index_args(args: argparse.Namespace) -> list[str]:
    out = ["--no-index"] if args.no_index else []
    out += ["--index-url", args.index_url] if args.index_url else []
    for url in args.extra_index_url:
        out += ["--extra-index-url", url]
    for d in args.find_links:
        out += ["--find-links", d]
    return out


def find_uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        raise BundleError("uv not found: `pip install uv` (launch/setup.sh installs it into .venv)")
    return uv


def project_requirement(project: Path, extra: str, work: Path) -> str:
    """Build the project's wheel (from a copy) and name it with the extra: ``spmd-rl[cuda] @ file://...``."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    names = sorted(meta["project"].get("optional-dependencies", {}))
    if extra not in names:
        raise BundleError(f"--extra {extra}: {project / 'pyproject.toml'} has no such extra (it has {names})")
    # setuptools writes build/ and *.egg-info beside the sources: build a copy, never the user's tree
    source = work / "source"
    shutil.copytree(project, source, ignore=shutil.ignore_patterns(*PROJECT_LEFT_OUT))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work)]
    subprocess.run(cmd + [str(source)], check=True, stdout=subprocess.DEVNULL)
    (wheel,) = work.glob("*.whl")
    name = canonical(wheel.name.split("-")[0])
    return f"{name}[{extra}] @ {wheel.resolve().as_uri()}"


def resolve(requirements: list[str], node: dict, args: argparse.Namespace, work: Path) -> list[tuple[str, str]]:
    """(name, ``==version`` or ``@ url``) of the whole closure for the node, its packages pinned
    but for the ``--replace`` ones."""
    (work / "requirements.in").write_text("\n".join(requirements) + "\n")
    free = {canonical(n) for n in args.replace}
    pins = [f"{name}=={public(v)}" for name, v in sorted(node["installed"].items()) if v and name not in free]
    (work / "constraints.txt").write_text("\n".join(pins) + "\n")
    cmd = [find_uv(), "pip", "compile", "-q", "--no-header", "--no-annotate", "--only-binary", ":all:"]
    cmd += ["--python-version", node["python"], "--python-platform", uv_platform(node)]
    for name in args.build:
        cmd += ["--no-binary", name]
    cmd += ["-c", str(work / "constraints.txt"), str(work / "requirements.in")] + index_args(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise BundleError(
            "no set of wheels fits the node and the requirements (the node's packages are fixed):\n"
            + done.stderr.strip()[-3000:]
            + "\nwhere one of the node's own packages blocks it, --replace NAME bundles the release the requirements"
            " need; installed with --target, it shadows the node's for programs that put the target first"
        )
    pinned = []
    for line in done.stdout.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(==\s*\S+|@\s*\S+)", line)
            if not m:
                raise RuntimeError(f"uv pip compile printed a line this tool does not read: {line!r}")
            pinned.append((canonical(m.group(1)), m.group(2).replace(" ", "")))
    return pinned


def build_pure_wheels(pins: list[str], args: argparse.Namespace, dest: Path) -> None:
    """Wheels of ``--build`` packages from their source releases, built here: only a pure-Python
    one (tag ``py3-none-any``) fits another node's Python and platform, so any other is refused.
    The build uses this environment's build backend (setuptools), not an isolated one."""
    if not pins:
        return
    built = dest / "built"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary=:all:", "--no-build-isolation"]
    cmd += ["-w", str(built)]  # built with this environment's setuptools: no index needed for the backend
    subprocess.run(cmd + index_args(args) + pins, check=True)
    for wheel in built.glob("*.whl"):
        tags = wheel.name[: -len(".whl")].split("-")[-3:]
        if tags[1:] != ["none", "any"] or not tags[0].startswith("py"):
            raise BundleError(f"--build {wheel.name}: not a pure-Python wheel; build it on a machine like the node")
        wheel.replace(dest / wheel.name)
    built.rmdir()


def download(missing: list[tuple[str, str]], node: dict, args: argparse.Namespace, dest: Path) -> list[Path]:
    """The wheels of ``missing``: index releases through pip (``--build`` ones built here from
    source), local files copied."""
    dest.mkdir(parents=True, exist_ok=True)
    source = {canonical(n) for n in args.build}
    build_pure_wheels([f"{n}{spec}" for n, spec in missing if n in source and spec.startswith("==")], args, dest)
    pins = [f"{name}{spec}" for name, spec in missing if spec.startswith("==") and name not in source]
    for name, spec in missing:
        if spec.startswith("@"):
            url = spec[1:]
            if not url.startswith("file://"):
                raise BundleError(f"{name} {spec}: only index releases and local files can be bundled")
            shutil.copy2(Path(url[len("file://") :]), dest)
    if pins:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
        cmd += ["--python-version", node["python"], "--implementation", "cp"]
        for tag in pip_platforms(node):
            cmd += ["--platform", tag]
        subprocess.run(cmd + index_args(args) + pins, check=True)
    got = {canonical(p.name.split("-")[0]): p for p in dest.glob("*.whl")}
    absent = [name for name, _ in missing if name not in got]
    if absent:
        raise BundleError(f"no wheel was downloaded for {absent}")
    return sorted(got[name] for name, _ in missing)


def split_by_node(pinned: list[tuple[str, str]], have: dict) -> tuple[dict, dict, list[tuple[str, str]]]:
    """What the node keeps (it has that release, or one of unknown version), what the bundle
    replaces (``--replace``d packages resolved to another release: name -> [node's, bundled]),
    and what the bundle carries (the replaced and the absent)."""
    kept, replaced, carried = {}, {}, []
    for name, spec in pinned:
        if name in have and (have[name] is None or spec == f"=={public(have[name])}"):
            kept[name] = have[name]
            continue
        if name in have:
            replaced[name] = [have[name], spec.lstrip("=")]
        carried.append((name, spec))
    return kept, replaced, carried


def write_parts(files: list[Path], out: Path, part_bytes: int) -> list[dict]:
    """Cut files into chunks of at most one part's room, pack them largest first into parts
    (first fit), and write them; returns the manifest's ``files`` list."""
    overhead = sum(p.stat().st_size for p in NODE_FILES) + 64 * 1024 + 512 * len(files)
    room = part_bytes - overhead
    if room < part_bytes // 2:
        raise BundleError(f"--part-mib {part_bytes / 2**20:g}: too small for the manifest and installer; use >= 1")
    chunks = []  # (size, file index, chunk index, offset)
    for i, f in enumerate(files):
        size = f.stat().st_size
        for k, offset in enumerate(range(0, max(size, 1), room)):
            chunks.append((min(room, size - offset), i, k, offset))
    free: list[int] = []
    placed = {}
    for size, i, k, offset in sorted(chunks, key=lambda c: -c[0]):
        slot = next((n for n, left in enumerate(free) if left >= size), None)
        if slot is None:
            free.append(room)
            slot = len(free) - 1
        free[slot] -= size
        placed[i, k] = (slot, offset, size)
    entries = []
    for i, f in enumerate(files):
        ks = sorted(k for (j, k) in placed if j == i)
        entry = {"name": f.name, "size": f.stat().st_size, "sha256": "", "chunks": []}
        whole = hashlib.sha256()
        with open(f, "rb") as src:
            for k in ks:
                slot, offset, size = placed[i, k]
                src.seek(offset)
                data = src.read(size)
                whole.update(data)
                part = f"part-{slot + 1:03d}"
                name = f.name if len(ks) == 1 else f"{f.name}.{k:03d}"
                (out / part).mkdir(parents=True, exist_ok=True)
                (out / part / name).write_bytes(data)
                entry["chunks"].append(
                    {"name": name, "part": part, "size": size, "sha256": hashlib.sha256(data).hexdigest()}
                )
        entry["sha256"] = whole.hexdigest()
        entries.append(entry)
    return entries


def finish_parts(out: Path, manifest: dict, part_bytes: int) -> list[tuple[str, int]]:
    """Write the manifest and the node's files into every part; check each part's size."""
    text = json.dumps(manifest, indent=1) + "\n"
    sizes = []
    for part in sorted(p for p in out.glob("part-*") if p.is_dir()):
        (part / "manifest.json").write_text(text)
        for f in NODE_FILES:
            shutil.copy2(f, part / f.name)
        size = sum(p.stat().st_size for p in part.iterdir())
        if size > part_bytes:
            raise RuntimeError(f"{part}: {size} bytes, over the {part_bytes}-byte part limit")
        sizes.append((part.name, size))
    return sizes


def make_bundle(args: argparse.Namespace) -> dict:
    node = node_from_args(args)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise BundleError(f"--out {out}: not empty; name a new folder (a bundle is never written over another)")
    requirements = list(args.requirements)
    with tempfile.TemporaryDirectory(prefix="offline-bundle-") as tmp:
        work = Path(tmp)
        if args.extra:
            requirements.append(project_requirement(Path(args.project), args.extra, work / "project"))
        if not requirements:
            raise BundleError("nothing to bundle: give requirements (e.g. vllm==0.26.0) or --extra cuda")
        pinned = resolve(requirements, node, args, work)
        kept, replaced, missing = split_by_node(pinned, node["installed"])
        excluded = sorted(name for name, _ in missing if any(fnmatch.fnmatch(name, canonical(x)) for x in args.exclude))
        missing = [(name, spec) for name, spec in missing if name not in excluded]
        files = download(missing, node, args, work / "wheels")
        part_bytes = int(args.part_mib * 2**20)
        entries = write_parts(files, out, part_bytes)
    manifest = {
        "format": FORMAT,
        "node": {"python": node["python"], "machine": node["machine"], "glibc": node["glibc"]},
        "kept": {name: v for name, v in sorted(kept.items()) if v},
        "replaced": replaced,
        "excluded": excluded,
        "requested": [r.split(" @ file://")[0] for r in requirements],  # the project's wheel is in files
        "files": entries,
    }
    sizes = finish_parts(out, manifest, part_bytes)
    total = sum(e["size"] for e in entries)
    print(f"[bundle] {len(entries)} wheels, {total / 2**20:.1f} MiB, in {len(sizes)} parts of <= {args.part_mib:g} MiB")
    print(
        f"[bundle] kept from the node ({len(kept)}): "
        + ", ".join(f"{k} {v or '(version unknown)'}" for k, v in sorted(kept.items()))
    )
    if excluded:
        print(f"[bundle] left out (--exclude; imports of them will fail): {', '.join(excluded)}")
    for name, (theirs, ours) in replaced.items():
        print(f"[bundle] replaced: {name} {theirs} -> {ours} (shadows the node's where the target comes first)")
    for name, size in sizes:
        print(f"[bundle]   {out / name}: {size / 2**20:.1f} MiB")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requirements", nargs="*", help="requirements to bundle, e.g. vllm==0.26.0")
    p.add_argument("--node", help="the node's `offline_install.py describe` output")
    p.add_argument("--python-version", help="without --node: the node's Python, e.g. 3.12")
    p.add_argument("--platform", help="without --node: manylinux_2_<glibc minor>_<machine>")
    p.add_argument("--freeze", help="without --node: the node's `pip freeze` output")
    p.add_argument("--extra", help="bundle this project with this extra (e.g. cuda)")
    p.add_argument("--project", default=str(REPO), help="the project folder --extra builds (default: this repo)")
    p.add_argument("--out", required=True, help="a new folder for part-001, part-002, ...")
    p.add_argument(
        "--replace",
        action="append",
        default=[],
        metavar="NAME",
        help="a package of the node the bundle may carry another release of (not torch)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out resolved packages the node will not import (fnmatch on the name); listed in the manifest",
    )
    p.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="NAME",
        help="a pure-Python package released as source only (python-etcd): built into a wheel here",
    )
    p.add_argument("--part-mib", type=float, default=60.0, help="largest part, MiB (default 60)")
    p.add_argument("--index-url")
    p.add_argument("--extra-index-url", action="append", default=[])
    p.add_argument("--find-links", action="append", default=[])
    p.add_argument("--no-index", action="store_true")
    args = p.parse_args(argv)
    try:
        make_bundle(args)
    except BundleError as e:
        print(f"[bundle] error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
