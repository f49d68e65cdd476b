"""The rollout engine: vLLM built in-process after the process group exists.

Under torchrun it uses ``distributed_executor_backend="external_launcher"`` so every rank hosts
its own engine and TP ranks of a generation group cooperate through torch.distributed.
Weights are replaced from an iterator of (HF name, full tensor): vLLM's loaders keep only
this rank's TP slice. On CPU vLLM repacks linear weights after loading, so updates go through
``reload_weights`` (which re-runs that processing), followed by ``reset_prefix_cache``.

Under separated placement (``own_process=True``) only the generators host an engine, so it
cannot share the torch world (vLLM would form its groups over every rank): it runs in its own
engine-core process with a one-rank world of its own, and new weights reach it as a file
(``engines.weight_receiver``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import RolloutConfig
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines import orphan_watch, vllm_shm, weight_file


RECEIVER = "spmd_rl.engines.weight_receiver.WeightReceiver"


def configure_vllm_env(rollout: RolloutConfig, own_process: bool = False) -> None:
    """Environment vLLM reads at import/build time; call before importing vllm."""
    if own_process:  # a fresh (spawned, not forked) engine-core process: no inherited torch world
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(rollout.kv_cache_gib))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class Sample:
    """One generated response: token ids and the sampler's log-prob of each: vLLM's processed
    log-probs, i.e. of softmax(logits / T) (renormalised over the top-k / top-p set when those
    are on), the distribution the token was drawn from."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool = False
    """Ended on a stop token (EOS), not on the token limit of its request."""


def engine_options(acc_kind: str, cfg: RolloutConfig, distributed: bool, own_process: bool = False) -> dict:
    """vLLM ``LLM(...)`` options from the config; the device-only ones (memory fraction, sleep
    mode for releasing the KV cache) only off CPU."""
    kw: dict = {"enforce_eager": cfg.enforce_eager, "enable_prefix_caching": False, "logprobs_mode": "processed_logprobs",
                "worker_extension_cls": RECEIVER, "use_tqdm_on_load": False}
    if own_process:
        kw["distributed_executor_backend"] = "uni"  # the worker inside the engine-core process
    elif distributed:
        kw["distributed_executor_backend"] = "external_launcher"
    if acc_kind != "cpu":
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kw["enable_sleep_mode"] = True
    return kw


def sampling_options(cfg: RolloutConfig, temperature: float, n: int, max_tokens: int, seed: int | None) -> dict:
    """``SamplingParams`` of one prompt: top-p / top-k only when sampling (temperature > 0)."""
    return {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": cfg.top_p if temperature > 0 else 1.0,
            "top_k": cfg.top_k if temperature > 0 else -1, "logprobs": 0, "seed": seed}


def _sample(completion) -> Sample:
    ids = list(completion.token_ids)
    return Sample(ids, [float(pos[t].logprob) for t, pos in zip(ids, completion.logprobs or [])], completion.finish_reason == "stop")


class RolloutEngine:
    def __init__(self, path: str | Path, acc: Accelerator, cfg: RolloutConfig, tp: int, dtype: str,
                 max_model_len: int, seed: int = 0, distributed: bool = True, own_process: bool = False):
        configure_vllm_env(cfg, own_process)
        from vllm import LLM

        self.cfg = cfg
        self.acc = acc
        self.tp = tp
        self.own_process = own_process
        self._asleep = False
        before = orphan_watch.children()
        vllm_shm.name_per_job()
        self.llm = LLM(model=str(path), dtype=dtype, tensor_parallel_size=tp, max_model_len=max_model_len, seed=seed,
                       **engine_options(acc.kind, cfg, distributed, own_process))
        if own_process:  # the engine core must not outlive this rank (engines.orphan_watch)
            self._watch = orphan_watch.OrphanWatch()
            self._watch.watch(orphan_watch.children() - before - {self._watch.proc.pid})
        else:  # every rank has mapped its communicators' segments: their names must not outlive it
            vllm_shm.unlink_segment_names()

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's module on this rank (its TP slice of the weights); in-process engines only."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float | None = None,
                 seed: int | None = None) -> list[Sample]:
        """n samples per prompt, prompt-major (sample i = prompt * n + k)."""
        done = dict(g for step in self.generate_stream(prompts, n, max_tokens, temperature, seed) for g in step)
        return [s for p in range(len(prompts)) for s in done[p]]

    def generate_stream(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float | None = None,
                        seed: int | None = None) -> Iterator[list[tuple[int, list[Sample]]]]:
        """After each engine step that finished prompt groups: [(prompt index, its n samples)].
        The samples are the ones ``generate`` returns (same requests, same per-request seeds
        seed + k)."""
        from vllm import SamplingParams

        temp = self.cfg.temperature if temperature is None else temperature
        per_request = 1 if temp == 0 else n  # vLLM's greedy mode takes n=1: repeat the prompts instead
        owners = [p for p in range(len(prompts)) for _ in range(n // per_request)]
        params = [SamplingParams(**sampling_options(self.cfg, temp, per_request, max_tokens, None if seed is None else seed + k))
                  for k in range(len(owners))]
        ids = self.llm.enqueue([{"prompt_token_ids": prompts[p]} for p in owners], params, use_tqdm=False)
        # vLLM returns its internal ids ("<external>-<random>"); outputs carry the external one
        slot = {rid.split("-", 1)[0]: (p, k) for k, (rid, p) in enumerate(zip(ids, owners))}
        groups: dict[int, list[tuple[int, list[Sample]]]] = {}
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            finished = []
            for out in engine.step():
                if not out.finished or out.request_id not in slot:
                    continue
                p, k = slot[out.request_id]
                got = groups.setdefault(p, [])
                got.append((k, [_sample(c) for c in sorted(out.outputs, key=lambda c: c.index)]))
                if len(got) * per_request == n:
                    finished.append((p, [s for _, samples in sorted(got) for s in samples]))
            if finished:
                yield finished

    def continue_samples(self, requests: list[tuple[list[int], int]], temperature: float | None = None,
                         seed: int | None = None) -> list[Sample]:
        """One sample per (context, max_tokens): at most max_tokens tokens continuing
        ``context`` (the prompt followed by the response so far); request k is seeded seed + k.
        Partial rollout's primitive: at temperature 0 a response continued in pieces equals the
        one generated at once (tested)."""
        from vllm import SamplingParams

        temp = self.cfg.temperature if temperature is None else temperature
        params = [SamplingParams(**sampling_options(self.cfg, temp, 1, m, None if seed is None else seed + k)) for k, (_, m) in enumerate(requests)]
        outs = self.llm.generate([{"prompt_token_ids": c} for c, _ in requests], params, use_tqdm=False)
        return [_sample(o.outputs[0]) for o in outs]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], meta: list[tuple[str, torch.dtype, list[int]]] | None = None) -> None:
        """Load new full weights and drop cached prefixes. In-process they are consumed lazily,
        one at a time. An engine in its own process reads them from a private file streamed
        here (``engines.weight_file``: header from ``meta`` [(name, dtype, shape)] in the
        iteration order, then one tensor at a time), so neither process holds the whole model
        twice."""
        is_cpu = self.acc.kind == "cpu"
        if self.own_process:
            if meta is None:
                raise ValueError("an engine in its own process loads weights from a file whose header needs meta=[(name, dtype, shape)]")
            with tempfile.TemporaryDirectory(prefix="spmd-rl-weights-") as folder:  # mode 0700
                path = os.path.join(folder, "weights.safetensors")
                weight_file.write(path, meta, iter(weights))
                self.llm.collective_rpc("load_weights_file", args=(path, is_cpu))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.collective_rpc("refresh_tied_lm_head", args=(is_cpu,))
        self.llm.reset_prefix_cache()

    def weight_bytes(self) -> int:
        """Bytes of this rank's generation weights. vLLM CPU moves linear weights into packed
        GEMM closures (their parameters become empty), so on CPU the count comes from the
        model's architecture: TP-split tensors / tp, replicated ones whole."""
        if self.acc.kind == "cpu":
            arch = ModelArch.from_dict(self.llm.llm_engine.model_config.hf_config.to_dict())
            itemsize = torch.empty((), dtype=self.llm.llm_engine.model_config.dtype).element_size()
            return sum(t.numel // self.tp if t.tp_split else t.numel for t in arch.tensors()) * itemsize
        return self.llm.collective_rpc("param_bytes")[0]

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache the engine actually allocated on this rank, not the configured budget."""
        return self.llm.collective_rpc("kv_cache_bytes")[0]

    def sleep(self) -> None:
        """Between rollouts: vLLM sleep level 1 (weights to host, KV cache discarded) where the
        platform supports it; vLLM has no sleep mode on CPU, so nothing happens there."""
        if self.acc.kind != "cpu" and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_weights(self) -> None:
        """Bring back the weights only (the KV cache stays released until ``wake_kv_cache``)."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def resident(self) -> bool:
        """Whether the weights and KV cache hold device memory now (always on CPU: no sleep mode)."""
        return not self._asleep
