"""The offline install, end to end on CPU with wheels made here (no index reached): describe a
node, bundle for it, reassemble and install with no index, import.

The node has ``torchlike 2.11.0+cu130`` (a local build, as a CUDA torch is) and ``beta 1.0``.
``alpha 2.0`` needs ``torchlike==2.13.0`` and ``alpha 1.0`` the node's 2.11.0: the bundle must
pick alpha 1.0 (the vLLM-for-this-torch choice), bundle neither torchlike nor beta (though
``beta 2.0`` is newer), and cut the 2.5 MiB ``big`` into chunks across 1 MiB parts."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import offline_bundle  # noqa: E402

sys.path.insert(0, str(REPO / "launch"))
import offline_install  # noqa: E402

BIG = int(2.5 * 2**20)


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), payload: int = 0) -> Path:
    """A pure-Python wheel: package ``name`` whose ``__version__`` is ``version``."""
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n".encode()}
    if payload:
        files[f"{name}/payload.bin"] = hashlib.shake_256(name.encode()).digest(payload)
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    files[f"{info}/METADATA"] = meta.encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
    return path


def run(*cmd, env_path: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if env_path:
        env["PYTHONPATH"] = env_path
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=240)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An index folder, a node (its site folder and its `describe`), and a bundle for it."""
    root = tmp_path_factory.mktemp("offline")
    index, local = root / "index", root / "local"
    index.mkdir()
    local.mkdir()
    make_wheel(index, "alpha", "1.0", ("beta>=1.0", "gamma", "torchlike==2.11.0"))
    make_wheel(index, "alpha", "2.0", ("beta", "gamma", "torchlike==2.13.0"))
    for v in ("1.0", "2.0"):
        make_wheel(index, "beta", v)
    make_wheel(index, "gamma", "1.0", ("big",))
    make_wheel(index, "big", "1.0", payload=BIG)
    for v in ("2.11.0", "2.13.0"):
        make_wheel(index, "torchlike", v)
    node_site = root / "node-site"
    node_wheels = [make_wheel(local, "torchlike", "2.11.0+cu130"), index / "beta-1.0-py3-none-any.whl"]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", node_site]
    assert run(*pip, *node_wheels).returncode == 0
    described = run(sys.executable, REPO / "launch" / "offline_install.py", "describe", env_path=str(node_site))
    assert described.returncode == 0, described.stderr
    (root / "node.json").write_text(described.stdout)
    out = root / "bundle"
    made = run(
        sys.executable, REPO / "tools" / "offline_bundle.py", "alpha", "--node", root / "node.json",
        "--no-index", "--find-links", index, "--part-mib", "1", "--out", out,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return {"root": root, "index": index, "node_site": node_site, "bundle": out, "log": made.stdout}


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "part-001" / "manifest.json").read_text())


def test_the_bundle_holds_what_the_node_lacks_resolved_against_what_it_has(world):
    m = manifest(world["bundle"])
    assert sorted(f["name"] for f in m["files"]) == [
        "alpha-1.0-py3-none-any.whl",  # 2.0 needs a torchlike the node does not have
        "big-1.0-py3-none-any.whl",
        "gamma-1.0-py3-none-any.whl",
    ]
    assert m["kept"] == {"beta": "1.0", "torchlike": "2.11.0+cu130"}  # beta 2.0 exists, the node's 1.0 stays
    assert m["node"]["python"] == "%d.%d" % sys.version_info[:2]


def test_parts_stay_under_their_size_and_chunks_rebuild_the_wheel(world):
    bundle, m = world["bundle"], manifest(world["bundle"])
    parts = sorted(p for p in bundle.iterdir() if p.is_dir())
    assert len(parts) >= 3
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 2**20, part
        assert {"manifest.json", "offline_install.py", "install_offline.sh"} <= {f.name for f in part.iterdir()}
    (big,) = [f for f in m["files"] if f["name"].startswith("big-")]
    assert len(big["chunks"]) >= 3 and len({c["part"] for c in big["chunks"]}) >= 3
    data = b"".join((bundle / c["part"] / c["name"]).read_bytes() for c in big["chunks"])
    original = world["index"] / big["name"]
    assert data == original.read_bytes() and hashlib.sha256(data).hexdigest() == big["sha256"]


def test_install_with_no_index_leaves_the_node_packages_alone(world, tmp_path):
    bundle = tmp_path / "copied"
    shutil.copytree(world["bundle"], bundle)
    target = tmp_path / "site"
    done = run("bash", bundle / "part-001" / "install_offline.sh", "install", bundle, "--target", target,
               env_path=str(world["node_site"]))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["alpha", "big", "gamma"]
    probe = (
        "import alpha, beta, big, gamma, torchlike; print(alpha.__version__, beta.__version__, torchlike.__version__)"
    )
    imported = run(sys.executable, "-c", probe, env_path=f"{target}{os.pathsep}{world['node_site']}", cwd=tmp_path)
    assert imported.stdout.split() == ["1.0", "1.0", "2.11.0+cu130"], imported.stderr
    assert (target / "big" / "payload.bin").stat().st_size == BIG


@pytest.mark.parametrize("damage", ["truncated", "missing part", "another node", "two bundles"])
def test_a_bad_bundle_or_node_exits_2_naming_it_and_installs_nothing(world, tmp_path, damage):
    bundle = tmp_path / "copied"
    shutil.copytree(world["bundle"], bundle)
    (big,) = [f for f in manifest(bundle)["files"] if f["name"].startswith("big-")]
    chunk = big["chunks"][1]
    node_path = str(world["node_site"])
    if damage == "truncated":
        path = bundle / chunk["part"] / chunk["name"]
        path.write_bytes(path.read_bytes()[:-1])
        expect = [chunk["name"], f"copy {chunk['part']} of the bundle again"]
    elif damage == "missing part":
        shutil.rmtree(bundle / chunk["part"])
        expect = [chunk["part"], chunk["name"], "copy those part folders"]
    elif damage == "another node":
        node_path = None  # neither torchlike nor beta
        expect = ["torchlike: the bundle was made for 2.11.0+cu130, this node has none", "describe"]
    else:
        other = json.loads((bundle / "part-002" / "manifest.json").read_text()) | {"requested": ["else"]}
        (bundle / "part-002" / "manifest.json").write_text(json.dumps(other))
        expect = ["different bundles"]
    target = tmp_path / "site"
    done = run(sys.executable, bundle / "part-001" / "offline_install.py", "install", bundle, "--target", target,
               env_path=node_path)  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    for text in expect:
        assert text in done.stderr
    assert not target.exists()


def test_a_node_package_in_the_way_is_named_and_replaced_only_when_asked(world, tmp_path):
    base = ["beta==2.0", "--node", str(world["root"] / "node.json"), "--no-index", "--find-links", str(world["index"])]
    assert offline_bundle.main([*base, "--out", str(tmp_path / "a")]) == 2  # the node's beta 1.0 is fixed
    assert offline_bundle.main([*base, "--out", str(tmp_path / "b"), "--replace", "beta"]) == 0
    m = manifest(tmp_path / "b")
    assert [f["name"] for f in m["files"]] == ["beta-2.0-py3-none-any.whl"]
    assert m["replaced"] == {"beta": ["1.0", "2.0"]} and m["kept"] == {}
    node = json.loads((world["root"] / "node.json").read_text())
    node["installed"]["beta"] = "1.5"  # the installer refuses a node whose replaced package moved
    with pytest.raises(offline_install.BundleError, match="beta: the bundle was made for 1.0, this node has 1.5"):
        offline_install.check_node(m, node)
    offline_install.check_node(m, json.loads((world["root"] / "node.json").read_text()))


def test_excluded_packages_are_left_out_and_listed(world, tmp_path):
    base = ["alpha", "--node", str(world["root"] / "node.json"), "--no-index", "--find-links", str(world["index"])]
    assert offline_bundle.main([*base, "--out", str(tmp_path / "b"), "--exclude", "BIG*"]) == 0
    m = manifest(tmp_path / "b")
    assert sorted(f["name"] for f in m["files"]) == ["alpha-1.0-py3-none-any.whl", "gamma-1.0-py3-none-any.whl"]
    assert m["excluded"] == ["big"] and len(list((tmp_path / "b").glob("part-*"))) == 1


def test_a_source_only_package_is_built_here_into_a_pure_wheel(world, tmp_path):
    import io
    import tarfile

    index = tmp_path / "index"
    index.mkdir()
    files = {
        "pyproject.toml": b'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        b'[project]\nname = "delta"\nversion = "1.0"\n',
        "delta/__init__.py": b"X = 1\n",
        "PKG-INFO": b"Metadata-Version: 2.1\nName: delta\nVersion: 1.0\n",
    }
    with tarfile.open(index / "delta-1.0.tar.gz", "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"delta-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    base = ["delta", "--node", str(world["root"] / "node.json"), "--no-index", "--find-links", str(index)]
    assert offline_bundle.main([*base, "--out", str(tmp_path / "a")]) == 2  # wheels only, unless asked
    assert offline_bundle.main([*base, "--out", str(tmp_path / "b"), "--build", "delta"]) == 0
    assert [f["name"] for f in manifest(tmp_path / "b")["files"]] == ["delta-1.0-py3-none-any.whl"]


def test_the_project_bundles_with_its_extra(tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "my-proj"\nversion = "0.3"\ndependencies = ["gamma"]\n'
        '[project.optional-dependencies]\ngpu = ["beta==1.0"]\n[tool.setuptools]\npy-modules = ["my_proj"]\n'
    )
    (project / "my_proj.py").write_text("")
    index = tmp_path / "index"
    index.mkdir()
    for name, version, requires in (("beta", "1.0", ()), ("beta", "2.0", ()), ("gamma", "1.0", ())):
        make_wheel(index, name, version, requires)
    node = {"python": "%d.%d" % sys.version_info[:2], "machine": "x86_64", "glibc": "2.28", "installed": {}}
    (tmp_path / "node.json").write_text(json.dumps(node))
    args = ["--node", str(tmp_path / "node.json"), "--no-index", "--find-links", str(index), "--out"]
    assert offline_bundle.main([*args, str(tmp_path / "b"), "--project", str(project), "--extra", "gpu"]) == 0
    names = sorted(f["name"] for f in manifest(tmp_path / "b")["files"])
    assert names == ["beta-1.0-py3-none-any.whl", "gamma-1.0-py3-none-any.whl", "my_proj-0.3-py3-none-any.whl"]
    assert sorted(p.name for p in project.iterdir()) == ["my_proj.py", "pyproject.toml"]  # built from a copy
    assert offline_bundle.main([*args, str(tmp_path / "c"), "--project", str(project), "--extra", "cuda"]) == 2


def test_platform_tags_widen_to_every_older_manylinux():
    tags = offline_bundle.pip_platforms({"machine": "x86_64", "glibc": "2.39"})
    assert tags[0] == "manylinux_2_39_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64"} <= set(
        tags
    )
    assert offline_bundle.uv_platform({"machine": "x86_64", "glibc": "2.45"}) == "x86_64-manylinux_2_40"
    with pytest.raises(offline_bundle.BundleError, match="glibc"):
        offline_bundle.pip_platforms({"machine": "x86_64", "glibc": ""})


def test_freeze_lines():
    text = "torch==2.11.0+cu130\n# comment\nFoo_Bar == 1.2\nmine @ file:///src/mine\n-e git+https://x/y#egg=dev_pkg\n"
    assert offline_bundle.parse_freeze(text) == {
        "torch": "2.11.0+cu130",
        "foo-bar": "1.2",
        "mine": None,
        "dev-pkg": None,
    }
    with pytest.raises(offline_bundle.BundleError, match="pip freeze"):
        offline_bundle.parse_freeze("torch>=2\n")


def test_the_acceptance_script_records_each_step_and_stops_without_an_install(tmp_path):
    """tools/gpu_acceptance.sh (issue 49's device run): a bundle that is not there stops it at
    the install step, recorded with the installer's exit status, before any device work."""
    done = run("bash", REPO / "tools" / "gpu_acceptance.sh", tmp_path / "no-bundle", tmp_path / "out")
    assert done.returncode == 1
    (line,) = (tmp_path / "out" / "status.tsv").read_text().splitlines()
    assert line.split("\t")[:2] == ["install", "2"]
    assert "no manifest.json" in (tmp_path / "out" / "install.log").read_text()
