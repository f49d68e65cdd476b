#!/usr/bin/env python
"""The tiny models' trained weights, committed in float16 under ``tools/tiny_weights/``, and
the asset folders built from them.

Training the four tiny models (the policy, its reward model, the tool model, the MoE sibling)
took about 8 minutes of a fresh setup on 2 cores, and gave each machine kind its own bytes. Their
weights are committed instead (7.8 MB), and ``materialize`` (the setup's step) builds each folder
under ``assets/`` with its builder's ``--weights`` option: tokenizer, config, data and report as
the builder always writes them, the weights from the file in float32. About half a minute in all,
and the same bytes on every machine.

Each file records, in its safetensors metadata, what trained it: the builder's arguments, the
report it wrote, and the losses of its first ``FIRST_STEPS`` steps. ``tests/unit/
test_tiny_weights.py`` runs the builders' current step functions for those steps and compares,
so a change to a builder's model, task, sampling, optimizer or defaults fails until the weights
are trained again with it (``rebuild``: about 8 minutes, then commit ``tools/tiny_weights/``).
The reward model's first steps start from the committed policy's weights (its trunk), as its
materialized folder does.

    python tools/tiny_weights.py materialize          # what is missing or stale under assets/
    python tools/tiny_weights.py rebuild              # train every model again, then pack
    python tools/tiny_weights.py pack --root DIR      # float16 weights + records from built folders
    python tools/tiny_weights.py pack --root DIR tiny-agent   # only the one named
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
WEIGHTS = TOOLS / "tiny_weights"
FIRST_STEPS = 5
"""Steps of each builder's training that the committed record holds and the test reproduces."""


@dataclass(frozen=True)
class Asset:
    """One trained model: its folder under a root, its builder and the arguments that build it
    (``{root}`` is the assets root), the file its builder writes last, its training threads."""

    name: str
    folder: str
    builder: str
    args: tuple[str, ...]
    done: str = "warmstart.json"
    threads: int = 1

    def path(self, root: Path) -> Path:
        return root / self.folder

    def argv(self, root: Path) -> list[str]:
        return [a.format(root=root) for a in self.args]

    @property
    def weights(self) -> Path:
        return WEIGHTS / f"{self.name}.safetensors"


POLICY = Asset("tiny-qwen2", "tiny-qwen2", "make_tiny_model.py", ("--out", "{root}/tiny-qwen2"))
REWARD = Asset(
    "tiny-qwen2-reward",
    "tiny-qwen2/reward_model",
    "make_tiny_reward_model.py",
    ("--model", "{root}/tiny-qwen2", "--out", "{root}/tiny-qwen2/reward_model"),
    done="train_report.json",
)
TOOL = Asset("tiny-tools", "tiny-tools", "make_tool_model.py", ("--out", "{root}/tiny-tools"))
AGENT = Asset("tiny-agent", "tiny-agent", "make_tool_model.py", ("--format", "hermes", "--out", "{root}/tiny-agent"))
"""The tool model whose calls are Hermes tool calls (configs/quickstart_agent.yaml)."""
MOE = Asset(
    "tiny-qwen3-moe",
    "tiny-qwen3-moe",
    "make_tiny_model.py",
    ("--arch", "qwen3_moe", "--out", "{root}/tiny-qwen3-moe"),
    threads=2,  # its expert dispatch sums in thread order: trained with two, as it always was
)
FLOORS = {TOOL.name: {"copy_accuracy": 0.9}, AGENT.name: {"copy_accuracy": 0.9}}
"""What a warm start must measure before it is packed. The training is chaotic in float rounding,
so another CPU trains other weights: the tool model trained on a 2-core AVX2-only EPYC copied the
tool's answer in 0.325 of tool conversations (an AVX512-BF16 EPYC's: 0.99), and the tool quickstart
went from 3.5 % to 40 % held-out accuracy in 60 iterations instead of 13.5 % to 94.5 % in 10."""
LANES = ((POLICY, REWARD, AGENT), (TOOL, MOE))
"""Built side by side; the reward model starts from the policy's folder, so it follows it."""
ASSETS = {a.name: a for lane in LANES for a in lane}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def current(asset: Asset, root: Path) -> bool:
    """Built from the committed weights as they are now (its report names their hash)."""
    done = asset.path(root) / asset.done
    return done.is_file() and json.loads(done.read_text()).get("weights_sha256") == sha256(asset.weights)


def run_builder(asset: Asset, root: Path, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(asset.threads))
    argv = [sys.executable, str(TOOLS / asset.builder), *asset.argv(root), *extra]
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"[tiny_weights] {asset.name}: {' '.join(argv[1:])} failed:\n{res.stderr[-3000:]}")
    print(f"[tiny_weights] {res.stdout.strip().splitlines()[-1]}", flush=True)


def materialize(root: Path, names: list[str] | None = None) -> None:
    """Build every asset (or those named) that is missing or not from the committed weights, two
    lanes side by side, one process at a time under ``root`` (a lock); then the preference data
    (seeded, from the policy's task)."""

    def lane(assets: tuple[Asset, ...]) -> None:
        for a in assets:
            if names and a.name not in names:
                continue
            if not a.weights.is_file():
                raise SystemExit(f"[tiny_weights] {a.weights} is missing: git checkout it, or train it (rebuild)")
            if current(a, root):
                print(f"[tiny_weights] present: {a.path(root)}", flush=True)
            else:
                run_builder(a, root, "--weights", str(a.weights))

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".materialize.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test workers asking at once build once
        with ThreadPoolExecutor(len(LANES)) as pool:
            list(pool.map(lane, LANES))
    prefs = POLICY.path(root) / "preferences_test.jsonl"
    if (not names or POLICY.name in names) and not prefs.is_file():
        subprocess.run(
            [sys.executable, str(TOOLS / "make_preference_data.py"), "--model", str(POLICY.path(root))], check=True
        )


def recorded(asset: Asset) -> dict:
    """The committed file's record: ``args``, ``report`` and ``first_losses``."""
    from safetensors import safe_open

    with safe_open(asset.weights, "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}


def builder_args(asset: Asset, root: Path) -> dict:
    """The builder's arguments as ``rebuild`` passes them, paths left out."""
    sys.path.insert(0, str(TOOLS))
    module = __import__(asset.builder.removesuffix(".py"))
    ns = vars(module.parser().parse_args(asset.argv(root)))
    return {k: v for k, v in sorted(ns.items()) if k not in ("out", "model", "weights")}


def first_losses(asset: Asset, root: Path, steps: int = FIRST_STEPS) -> list[float]:
    """The losses of the builder's first ``steps`` training steps, by its own step function
    (the reward model's from the policy folder under ``root``)."""
    import torch

    sys.path.insert(0, str(TOOLS))
    threads = torch.get_num_threads()
    torch.set_num_threads(asset.threads)
    try:
        return _first_losses(asset, root, steps, argparse.Namespace(**builder_args(asset, root)))
    finally:
        torch.set_num_threads(threads)


def _first_losses(asset: Asset, root: Path, steps: int, args: argparse.Namespace) -> list[float]:
    if asset is REWARD:
        import make_tiny_reward_model as m

        tok, model = m.initial_model(POLICY.path(root), args.seed)
        rows = [json.loads(line) for line in (POLICY.path(root) / "train.jsonl").read_text().splitlines()]
        gen = m.reward_steps(model, tok, rows, args.seed, args.batch_size, args.lr)
    elif asset in (TOOL, AGENT):
        import make_tool_model as m

        tok = m.tokenizer_for(args.format)
        model, (train, _) = m.build_model(tok, args.seed), m.make_task(args.seed, args.n_train, args.n_test)
        gen = m.sft_steps(model, tok, train, args)
    else:
        import make_tiny_model as m

        tok = m.build_tokenizer()
        model = (m.build_moe_model if args.arch == "qwen3_moe" else m.build_model)(tok, args.seed)
        gen = m.sft_steps(model, tok, m.make_task(args.seed, args.n_test)[0], args)
    return [next(gen) for _ in range(steps)]


def pack(root: Path, names: list[str] | None = None) -> None:
    """Write each built folder's weights (or only those named) in float16 with its record to
    ``tools/tiny_weights/``. The reward model's first losses start from the packed policy
    (materialized into a scratch folder first), as the test's do."""
    import torch
    from safetensors.torch import load_file, save_file

    WEIGHTS.mkdir(exist_ok=True)
    meta, chosen = {}, [a for a in ASSETS.values() if not names or a.name in names]
    for a in chosen:
        state = load_file(a.path(root) / "model.safetensors")
        big = max(float(t.abs().max()) for t in state.values())
        if big > 6e4:
            raise SystemExit(f"[tiny_weights] {a.name}: a weight of {big:g} does not fit float16")
        report = json.loads((a.path(root) / a.done).read_text())
        report.pop("weights_sha256", None)  # a folder built from earlier committed weights
        short = {k: report.get(k) for k, v in FLOORS.get(a.name, {}).items() if not report.get(k, 0) >= v}
        if short:
            raise SystemExit(
                f"[tiny_weights] {a.name}: its warm start measured {short}, under {FLOORS[a.name]}: "
                "not packed (train it on another machine, or with other arguments)"
            )
        meta[a.name] = {"args": builder_args(a, root), "report": report}
        half = {k: t.to(torch.float16).contiguous() for k, t in state.items()}
        save_file(half, a.weights, metadata={k: json.dumps(v) for k, v in meta[a.name].items()})
    with tempfile.TemporaryDirectory() as scratch:
        materialize(Path(scratch), [POLICY.name])
        for a in chosen:
            meta[a.name]["first_losses"] = first_losses(a, Path(scratch))
            state = load_file(a.weights)
            save_file(state, a.weights, metadata={k: json.dumps(v) for k, v in meta[a.name].items()})
            print(f"[tiny_weights] wrote {a.weights} ({a.weights.stat().st_size / 1e6:.2f} MB)", flush=True)


def rebuild() -> None:
    """Train every model from scratch into a scratch root (the lanes side by side), then pack."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        with ThreadPoolExecutor(len(LANES)) as pool:
            list(pool.map(lambda lane: [run_builder(a, root) for a in lane], LANES))
        pack(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("materialize", help="build what is missing or stale under --root from the committed weights")
    m.add_argument("names", nargs="*", help=f"only these assets, of {', '.join(ASSETS)}")
    m.add_argument("--root", type=Path, default=REPO / "assets")
    p = sub.add_parser("pack", help="commit the weights of the folders built under --root")
    p.add_argument("names", nargs="*", help=f"only these assets, of {', '.join(ASSETS)}")
    p.add_argument("--root", type=Path, default=REPO / "assets")
    sub.add_parser("rebuild", help="train every model from scratch, then pack")
    args = ap.parse_args()
    if args.command == "materialize":
        unknown = set(args.names) - set(ASSETS)
        if unknown:
            ap.error(f"unknown asset(s) {sorted(unknown)}: choose from {', '.join(ASSETS)}")
        materialize(args.root, args.names)
    elif args.command == "pack":
        pack(args.root, args.names)
    else:
        rebuild()


if __name__ == "__main__":
    main()
