"""Checkpoint -> HF folder, or a LoRA checkpoint -> PEFT adapter folder.

A full model is written shard by shard (``stream_shards``): its tensors are grouped, in the
checkpoint's order, into files of at most ``max_shard_bytes`` in the output dtype
(``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``, HF's layout; one
file ``model.safetensors`` when it fits). Each file's header is written first
(``trainer.safetensors_file``), then its tensors are read from the DCP checkpoint a chunk at a
time, cast and appended. Peak host memory is one read chunk (a quarter shard in the stored
dtype, or the largest tensor alone) twice over, as DCP's reader buffers a tensor's bytes before
copying them into it, plus its cast: not the model, its optimizer state or a shard
(``tools/bench_export.py``: 275 MB against 1.5 GB for a 0.5 GB float32 model whose embedding
is 131 MB). Names are
HF's on-disk names: an MoE layer fused in memory (``engines.training.fused_experts``) is split
into its experts, and a tied LM head is left out, as ``save_pretrained`` does. The output dtype
is the run's ``model.dtype`` unless asked otherwise: a bfloat16 run's float32 master weights
export at half the bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spmd_rl.engines.training import fused_experts, lora
from spmd_rl.engines.training.safe_dcp import read_tensors, tensor_shapes
from spmd_rl.trainer.checkpoint import model_weights, read_state
from spmd_rl.trainer.safetensors_file import SafetensorsWriter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 5 * 10**9
"""Default file size limit: HF's ``max_shard_size="5GB"``."""
INDEX = "model.safetensors.index.json"


def export(
    checkpoint_dir: str | Path,
    out: str | Path,
    merged: bool = False,
    dtype: str | None = None,
    max_shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write the actor of a DCP checkpoint as an HF folder (module docstring) with the base
    model's config and tokenizer, in ``dtype`` (default: the run's ``model.dtype``). A LoRA
    checkpoint (adapters only) becomes its adapter folder in PEFT's layout, or with ``merged``
    the HF model with W + (alpha / r) B A."""
    state = read_state(checkpoint_dir)
    stored = tensor_shapes(checkpoint_dir, "model.")  # verified: a tampered checkpoint is refused before anything else
    out = Path(out)
    target = DTYPES[dtype or state.get("config", {}).get("model", {}).get("dtype", "float32")]
    if "lora" in state and not merged:
        return write_adapter(model_weights(checkpoint_dir), state, out)
    config = AutoConfig.from_pretrained(state["model_path"])
    if "lora" in state:
        model = AutoModelForCausalLM.from_pretrained(state["model_path"], dtype=torch.float32)
        merge_adapters(model, model_weights(checkpoint_dir), state["lora"])
        model.to(target).save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_bytes)
    else:
        out.mkdir(parents=True, exist_ok=True)
        stream_shards(checkpoint_dir, stored, on_disk_names(stored, config), target, out, max_shard_bytes)
        config.dtype = target
        config.save_pretrained(out)
        if (Path(state["model_path"]) / "generation_config.json").is_file():
            shutil.copy(Path(state["model_path"]) / "generation_config.json", out)
    AutoTokenizer.from_pretrained(state["tokenizer_path"]).save_pretrained(out)
    return out


def on_disk_names(stored: dict[str, tuple[list[int], torch.dtype]], config) -> dict[str, tuple[str, list[int]]]:
    """HF name -> (checkpoint name, shape) of the checkpoint's weights ``stored`` (their
    ``tensor_shapes``), checked against the base model's parameters (built on the meta device: no
    memory); ValueError naming what does not match."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = {
        disk: (name, piece)
        for name, (shape, _) in stored.items()
        if not (tied and name == "lm_head.weight")  # the embedding's storage (save_pretrained leaves it out too)
        for disk, piece in fused_experts.split_shape(name, shape)
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {d for n, p in model.named_parameters() for d, _ in fused_experts.split_shape(n, list(p.shape))}
    expected -= {"lm_head.weight"} if tied else set()
    if set(out) != expected:
        missing, unexpected = sorted(expected - set(out)), sorted(set(out) - expected)
        raise ValueError(
            f"checkpoint does not match the base model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return out


def stream_shards(
    checkpoint_dir: str | Path, stored: dict, names: dict, dtype: torch.dtype, out: Path, max_shard_bytes: int
) -> list[Path]:
    """Write ``names`` (``on_disk_names`` of the checkpoint's ``stored`` weights) shard by shard
    (module docstring); returns the files."""
    size = torch.tensor([], dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for disk, (_, shape) in names.items():
        nbytes = size * int(torch.Size(shape).numel())
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(disk)
        used += nbytes
    files = [
        out / ("model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        for k in range(len(shards))
    ]
    weight_map: dict[str, str] = {}
    for shard, path in zip(shards, files):
        writer = SafetensorsWriter(path, [(d, names[d][1]) for d in shard], dtype, {"format": "pt"})
        for disk, tensor in _read(
            checkpoint_dir, stored, [(d, names[d][0]) for d in shard], dtype, max_shard_bytes // 4
        ):
            writer.write(disk, tensor)
        writer.close()
        weight_map |= dict.fromkeys(shard, path.name)
    if len(files) > 1:
        total = sum(size * int(torch.Size(shape).numel()) for _, shape in names.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _read(checkpoint_dir, stored: dict, items: list[tuple[str, str]], dtype: torch.dtype, chunk_bytes: int):
    """(HF name, tensor in ``dtype``) of ``items`` ((HF name, checkpoint name), in order): read
    from the checkpoint in chunks of at most ``chunk_bytes`` stored bytes (a tensor larger than
    that alone), each handed on before the next chunk is read; a fused tensor is split once."""
    wanted: dict[str, list[str]] = {}
    for disk, name in items:
        wanted.setdefault(name, []).append(disk)
    sources = list(wanted)
    chunk: dict[str, tuple[list[int], torch.dtype]] = {}
    held = 0
    for k, name in enumerate(sources):
        shape, stored_dtype = chunk[name] = stored[name]
        held += int(torch.Size(shape).numel()) * stored_dtype.itemsize
        if k + 1 < len(sources) and held < chunk_bytes:
            continue
        read = read_tensors(checkpoint_dir, "model", chunk)
        for src in chunk:
            pieces = dict(fused_experts.split(src, read.pop(src)))
            for disk in wanted[src]:
                yield disk, pieces[disk].to(dtype)
        chunk, held = {}, 0


@torch.no_grad()
def merge_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor], cfg: dict) -> None:
    """W += (alpha / r) B A for every adapted linear layer, in float32 (``engines.training.lora``)."""
    params = dict(model.named_parameters())
    scale = cfg["alpha"] / cfg["rank"]
    for name in sorted(n[: -len(".lora_A")] for n in adapters if n.endswith(".lora_A")):
        if f"{name}.weight" not in params:
            raise ValueError(f"adapter {name!r} of the checkpoint names no layer of the base model {cfg}")
        w = params[f"{name}.weight"]
        w += (scale * adapters[f"{name}.lora_B"].float() @ adapters[f"{name}.lora_A"].float()).to(w.dtype)


def write_adapter(adapters: dict[str, torch.Tensor], state: dict, out: Path) -> Path:
    """PEFT's adapter folder (``engines.training.lora.write_peft_folder``) with the tokenizer beside it."""
    cfg = state["lora"]
    lora.write_peft_folder(
        out,
        adapters,
        str(Path(state["model_path"]).resolve()),
        cfg["rank"],
        cfg["alpha"],
        cfg["dropout"],
        cfg["target_modules"],
    )
    AutoTokenizer.from_pretrained(state["tokenizer_path"]).save_pretrained(out)
    return out


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "trainer_state.json").is_file()
