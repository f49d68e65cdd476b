#!/usr/bin/env python3
"""The node's half of an offline install: describe the node, then check, reassemble and install
a bundle that ``tools/offline_bundle.py`` made for it. Standard library only (Python >= 3.8): it
runs on an air-gapped node before anything is installed there.

    python3 offline_install.py describe > node.json               # on the node; carry node.json out
    python3 tools/offline_bundle.py --node node.json --extra cuda --out bundle   # where PyPI is
    python3 offline_install.py install BUNDLE [--target DIR]      # on the node, parts copied in

``BUNDLE`` holds the part folders ``part-001/``, ``part-002/``, ... (or their files in one folder).
Every part carries ``manifest.json``, this file and ``install_offline.sh``, so any one part
starts the install. The manifest (format 1)::

    {"format": 1,
     "node": {"python": "3.12", "machine": "x86_64", "glibc": "2.39"},
     "kept": {"torch": "2.11.0+cu130", ...},   # the node's own distributions the bundle relies on
     "replaced": {"numpy": ["2.5.2", "2.4.4"]}, # node's release, bundled one (offline_bundle --replace)
     "requested": ["spmd-rl[cuda] @ ...", ...],
     "excluded": ["pynvvideocodec", ...],       # resolved, left out on purpose (offline_bundle --exclude)
     "files": [{"name": "vllm-0.26.0-...whl", "size": N, "sha256": H,
                "chunks": [{"name": "vllm-...whl.000", "part": "part-001", "size": n, "sha256": h}, ...]}]}

A file is the concatenation of its chunks in order.

Invariants:
- nothing is installed unless every chunk and every reassembled file has the manifest's size and
  sha256 (a part damaged or cut short in transfer is named, with the fix);
- the node's own distributions are left alone: pip installs the bundle's wheels with
  ``--no-deps`` (the bundle is already the resolved closure), and a node whose kept
  distributions differ from the manifest's (another torch, say) is refused before anything is
  written, because the bundle was resolved against them;
- a user error (missing or damaged part, parts of two bundles, another node) exits 2;
- the parts are never modified: the wheels are reassembled into ``BUNDLE/wheels/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

FORMAT = 1
BUFFER = 1 << 20


class BundleError(Exception):
    """A user error: the message names the part, file or distribution and the fix."""


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def glibc_version() -> str:
    """The C library's version (``2.39``), or empty where it is not glibc."""
    lib, version = platform.libc_ver()
    return version if lib == "glibc" else ""


def describe() -> dict:
    """What a bundle must be made for: this interpreter's version, the machine, glibc, and every
    distribution this interpreter sees (name -> version, local labels such as ``+cu130`` kept)."""
    from importlib import metadata

    installed = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed[canonical(name)] = dist.version
    return {
        "format": FORMAT,
        "python": "%d.%d" % sys.version_info[:2],
        "implementation": sys.implementation.name,
        "machine": platform.machine(),
        "glibc": glibc_version(),
        "installed": dict(sorted(installed.items())),
    }


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BUFFER), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(bundle: Path) -> dict:
    """The one manifest every part carries; parts of two different bundles are refused."""
    found = sorted(bundle.glob("manifest.json")) + sorted(bundle.glob("*/manifest.json"))
    if not found:
        raise BundleError(f"{bundle}: no manifest.json: copy the bundle's part folders (part-001, ...) into {bundle}")
    texts = {p.read_bytes() for p in found}
    if len(texts) > 1:
        raise BundleError(
            f"{bundle}: the parts hold {len(texts)} different manifests ({', '.join(str(p) for p in found)}):"
            " they come from different bundles; keep the parts of one bundle only"
        )
    manifest = json.loads(texts.pop())
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{found[0]}: manifest format {manifest.get('format')!r}, this installer reads {FORMAT}")
    return manifest


def locate_chunks(bundle: Path, manifest: dict) -> dict:
    """(file, chunk index) -> path of every chunk; all missing ones are named at once, by part."""
    where, missing = {}, {}
    for f in manifest["files"]:
        for i, chunk in enumerate(f["chunks"]):
            candidates = (bundle / chunk["part"] / chunk["name"], bundle / chunk["name"])
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                missing.setdefault(chunk["part"], []).append(chunk["name"])
            else:
                where[f["name"], i] = path
    if missing:
        lines = [f"  {part}: {', '.join(names)}" for part, names in sorted(missing.items())]
        raise BundleError(
            f"{bundle}: chunks missing from {len(missing)} part(s):\n"
            + "\n".join(lines)
            + f"\ncopy those part folders of the bundle into {bundle} and run the install again"
        )
    return where


def check_node(manifest: dict, node: dict) -> None:
    """Refuse a node the bundle was not resolved for: another Python, machine, or kept version."""
    want = manifest["node"]
    if (want["python"], want["machine"]) != (node["python"], node["machine"]):
        raise BundleError(
            f"the bundle is for Python {want['python']} on {want['machine']}; this interpreter is Python "
            f"{node['python']} on {node['machine']}: run the installer with the node's Python (PYTHON=...),"
            " or make the bundle from this node's `describe`"
        )
    made_for = dict(manifest["kept"], **{name: pair[0] for name, pair in manifest.get("replaced", {}).items()})
    differ = [
        f"  {name}: the bundle was made for {version}, this node has {node['installed'].get(name, 'none')}"
        for name, version in sorted(made_for.items())
        if node["installed"].get(name) != version
    ]
    if differ:
        raise BundleError(
            "this node's own packages differ from the ones the bundle was resolved against:\n"
            + "\n".join(differ)
            + "\nrun `offline_install.py describe > node.json` here and make the bundle again from that file"
        )


def assemble(manifest: dict, where: dict, out: Path) -> list[Path]:
    """Concatenate each file's chunks into ``out``, checking every chunk and the whole file."""
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for n, f in enumerate(manifest["files"], 1):
        target = out / f["name"]
        if target.is_file() and target.stat().st_size == f["size"] and sha256_of(target) == f["sha256"]:
            wheels.append(target)
            continue
        whole = hashlib.sha256()
        partial = target.with_name(target.name + ".partial")
        with open(partial, "wb") as dst:
            for i, chunk in enumerate(f["chunks"]):
                data = where[f["name"], i].read_bytes()
                if len(data) != chunk["size"] or hashlib.sha256(data).hexdigest() != chunk["sha256"]:
                    partial.unlink()
                    raise BundleError(
                        f"{where[f['name'], i]}: damaged ({len(data)} bytes, the manifest says {chunk['size']}, or"
                        f" its sha256 differs): copy {chunk['part']} of the bundle again"
                    )
                whole.update(data)
                dst.write(data)
        if whole.hexdigest() != f["sha256"]:
            partial.unlink()
            raise BundleError(
                f"{f['name']}: reassembled, its sha256 differs from the manifest's: make the bundle again"
            )
        partial.replace(target)
        wheels.append(target)
        print(f"[offline] {n}/{len(manifest['files'])} checked {f['name']} ({f['size'] / 2**20:.1f} MiB)", flush=True)
    return wheels


def install(bundle: Path, target: Path | None) -> None:
    manifest = read_manifest(bundle)
    where = locate_chunks(bundle, manifest)
    check_node(manifest, describe())
    wheels = assemble(manifest, where, bundle / "wheels")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "-q"]
    cmd += ["--disable-pip-version-check"] + (["--target", str(target)] if target else [])
    print(f"[offline] installing {len(wheels)} wheels" + (f" into {target}" if target else ""), flush=True)
    subprocess.run(cmd + [str(w) for w in wheels], check=True)
    kept = ", ".join(f"{k} {v}" for k, v in sorted(manifest["kept"].items())[:6])
    print(f"[offline] installed; the node's own packages were left as they are ({kept}, ...)", flush=True)
    if target:
        print(f"[offline] use it with: export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("describe", help="print this node's Python, machine, glibc and installed packages as JSON")
    p = sub.add_parser("install", help="check, reassemble and install a bundle")
    p.add_argument("bundle", type=Path, help="the folder holding the bundle's part folders")
    p.add_argument("--target", type=Path, help="install into this folder (use with PYTHONPATH) instead of the env")
    args = parser.parse_args(argv)
    try:
        if args.command == "describe":
            json.dump(describe(), sys.stdout, indent=1)
            print()
        else:
            install(args.bundle, args.target)
    except BundleError as e:
        print(f"[offline] error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"[offline] error: pip failed ({e.returncode}); the wheels are in the bundle's wheels/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
