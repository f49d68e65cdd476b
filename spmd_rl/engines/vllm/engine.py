"""The vLLM rollout engine (``rollout.engine: vllm``), built in-process after the process group exists.

Under torchrun it uses ``distributed_executor_backend="external_launcher"`` so every rank hosts
its own engine and TP ranks of a generation group cooperate through torch.distributed.
Weights are replaced from an iterator of (HF name, full tensor): vLLM's loaders keep only
this rank's TP slice. On CPU vLLM repacks linear weights after loading, so updates go through
``reload_weights`` (which re-runs that processing; through the worker extension's ``reload_in_config``,
in vLLM's config context on every release), followed by ``reset_prefix_cache``.

Under separated placement (``own_process=True``) only the generators host an engine, so it
cannot share the torch world (vLLM would form its groups over every rank): it runs in its own
engine-core process with a one-rank world of its own, and new weights reach it as a file in
shared memory (``engines.vllm.handoff``, read by ``engines.vllm.weight_receiver``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
from collections.abc import Iterable

import torch

from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.rollout_engines import ROLLOUTS
from spmd_rl.distributed import teardown
from spmd_rl.engines.base import Rollout, RolloutBuild, Sample, SamplingSpec
from spmd_rl.distributed import orphan_watch
from spmd_rl.engines.vllm import handoff, weight_file
from spmd_rl.engines.vllm import shm as vllm_shm
from spmd_rl.engines.vllm.adapter_sync import AdapterSync
from spmd_rl.engines.vllm import compat, cpu_kernels
from spmd_rl.engines.vllm.options import (
    child_device_env,
    configure_vllm_env,
    eager_child_env,
    eager_sampler,
    engine_options,
    sampling_options,
)

log = logging.getLogger("spmd_rl")


@contextlib.contextmanager
def _child_env(extra: dict[str, str]):
    """``extra`` in the environment while a child process is spawned, the old values after."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _sample(completion, routes: torch.Tensor | None = None) -> Sample:
    ids = list(completion.token_ids)
    return Sample(
        ids,
        [float(pos[t].logprob) for t, pos in zip(ids, completion.logprobs or [])],
        completion.finish_reason == "stop",
        routes,
    )


def _vllm_options(build: RolloutBuild, version: str) -> dict:
    """``LLM(...)``'s options for ``build`` on this vLLM release (``options.engine_options``, then
    ``compat``), after the release's checks: a warning off the tested release, LoRA refused where
    vLLM's base-weight reload crashes with it, CPU route recording where the CPU MoE hides routes."""
    if (warning := compat.check_version(version)) is not None:
        log.warning(warning)
    if build.lora is not None:
        compat.check_lora(version)
    if build.record_routes and build.acc.kind == "cpu":
        compat.check_cpu_routes(version)
    options = engine_options(
        build.acc.kind,
        build.cfg,
        build.distributed,
        build.own_process,
        build.dummy_weights,
        build.record_routes,
        build.expert_parallel,
        None if build.lora is None else build.lora.rank,
    )
    return compat.adjust_engine_options(version, options)


def _freeze_import_heap() -> None:
    """Move every object alive now (mostly the imports': about 650 k after torch, transformers
    and vLLM) to the collector's permanent generation, after one full collection (so no garbage
    is kept). vLLM does the same once its engine has started (``freeze_gc_heap``), but its model
    load makes two full collections before that and its freeze a third, each walking the whole
    heap (0.6-0.9 s on a 2-core Xeon); frozen here, they walk only what came after, and this one
    collection replaces the three."""
    gc.collect()
    gc.freeze()


class VllmRollout(Rollout):
    capabilities = ROLLOUTS.meta["vllm"]

    def __init__(self, build: RolloutBuild):
        """See ``RolloutBuild``. With ``record_routes`` prefix caching is off on CPU and before vLLM
        0.31 (a cached prompt block is never computed and so never routed; ``compat``);
        ``expert_parallel`` is vLLM's expert parallelism over the engine's TP ranks (devices only);
        ``lora`` serves the adapters through vLLM's LoRA requests (``engines.vllm.adapter_sync``,
        vLLM 0.28 or later). Build this engine before any training role
        takes device memory: vLLM's start-up check wants ``gpu_memory_utilization`` x total free."""
        path, acc, cfg, tp, own_process = build.path, build.acc, build.cfg, build.tp, build.own_process
        dummy_weights, record_routes = build.dummy_weights, build.record_routes
        configure_vllm_env(cfg, own_process)
        import vllm
        from vllm import LLM

        options = _vllm_options(build, vllm.__version__)
        self.cfg = cfg
        self.acc = acc
        self.tp = tp
        self.own_process = own_process
        self._asleep = False
        self.weights_current = not dummy_weights
        """False while the engine holds no policy's weights (dummy, or discarded by a level-2 sleep)."""
        before = orphan_watch.children()
        vllm_shm.name_per_job()
        precision = torch.get_float32_matmul_precision()  # vLLM's worker sets it process-wide
        if not own_process:
            _freeze_import_heap()
            cpu_kernels.register_once()  # in this process's worker: once, or already in a preload server
        with (
            _child_env(
                child_device_env(acc.kind, acc.local_rank, dict(os.environ)) | eager_child_env(cfg)
                if own_process
                else {}
            ),
            eager_sampler(cfg),  # vLLM 0.26's CPU warm-up samples too (compat)
        ):
            self.llm = LLM(
                model=str(path),
                dtype=build.dtype,
                tensor_parallel_size=tp,
                max_model_len=build.max_model_len,
                seed=build.seed,
                **options,
            )
        lora = build.lora
        self.adapters = None if lora is None else AdapterSync(path, lora.rank, lora.alpha, lora.target_modules)
        torch.set_float32_matmul_precision(precision)
        self.record_routes = record_routes
        self._open: dict[str, tuple[object, list[int], str, int]] = {}
        """Unfinished requests: vLLM's external id -> (key, context, internal id, n)."""
        if record_routes and acc.kind == "cpu":  # on a device vLLM returns them itself (engines.vllm.options)
            self.llm.collective_rpc("start_routes")
        if own_process:  # the engine core must not outlive this rank (distributed.orphan_watch)
            self.handoff = handoff.Handoff()
            atexit.register(self.handoff.close)
            self._watch = orphan_watch.OrphanWatch()
            self._watch.watch(orphan_watch.children() - before - {self._watch.proc.pid})
        else:  # every rank has mapped its communicators' segments: their names must not outlive it
            vllm_shm.unlink_segment_names()
            teardown.keep_until_exit(self.llm, compat.core_finalizer(self.llm))  # a rank's exit frees it

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's module on this rank (its TP slice of the weights); in-process engines only."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def _begin_batch(self) -> None:
        """The CPU worker's route capture keeps routes until taken: a new batch starts from none."""
        if self.record_routes and self.acc.kind == "cpu":
            self.llm.collective_rpc("drop_routes")

    def submit(self, requests: list[tuple[object, list[int]]], specs: list[SamplingSpec]) -> None:
        """Requests may be added while others run (vLLM schedules them continuously): multi-turn
        rollouts submit a trajectory's next turn as soon as its tool returns. vLLM names requests
        internally "<external>-<random>" (outputs carry the external id) and the i-th sample of an
        n > 1 request "<i>_<internal>"."""
        self._require_weights()
        params = [self._params(spec) for spec in specs]
        ids = self.llm.enqueue(
            [{"prompt_token_ids": c} for _, c in requests],
            params,
            use_tqdm=False,
            lora_request=self.adapters.request if self.adapters else None,
        )
        self._open.update(
            {rid.split("-", 1)[0]: (key, ctx, rid, p.n) for (key, ctx), rid, p in zip(requests, ids, params)}
        )

    def busy(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[tuple[object, list[Sample]]]:
        """One vLLM engine step."""
        done = []
        with eager_sampler(self.cfg):
            outs = self.llm.llm_engine.step()
        for out in outs:
            if not out.finished or out.request_id not in self._open:
                continue
            key, context, rid, n = self._open.pop(out.request_id)
            outputs = sorted(out.outputs, key=lambda c: c.index)
            routes = self._routes(context, outputs, rid, n) if self.record_routes else [None] * len(outputs)
            done.append((key, [_sample(c, r) for c, r in zip(outputs, routes)]))
        return done

    def _params(self, spec: SamplingSpec):
        """vLLM's sampling params of one request under the rollout config."""
        from vllm import SamplingParams

        return SamplingParams(
            **sampling_options(self.cfg, spec.temperature, spec.n, spec.max_tokens, spec.seed, spec.top_p)
        )

    def _routes(self, context: list[int], outputs: list, rid: str, n: int) -> list[torch.Tensor]:
        """The recorded routes of a finished request's samples, checked to cover every position
        of context + sample but the last: taken from the CPU worker's capture, or vLLM's own
        ``routed_experts`` on a device."""
        names = [f"{c.index}_{rid}" if n > 1 else rid for c in outputs]
        if self.acc.kind == "cpu":
            tables = self.llm.collective_rpc("take_routes", args=(names,))[0]
        else:
            tables = {name: c.routed_experts for name, c in zip(names, outputs)}
        out = []
        for name, c in zip(names, outputs):
            table = tables[name]
            if table is None:
                raise RuntimeError(
                    f"vLLM returned no routed experts for request {name}: is enable_return_routed_experts on?"
                )
            if table.shape[0] != len(context) + len(c.token_ids) - 1:
                raise RuntimeError(
                    f"vLLM routed {table.shape[0]} positions of request {name}, expected "
                    f"{len(context) + len(c.token_ids) - 1} (prompt {len(context)} + response {len(c.token_ids)} - 1)"
                )
            out.append(torch.from_numpy(table.astype("uint8", copy=False)).flatten())
        return out

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], meta: list[tuple[str, torch.dtype, list[int]]] | None = None
    ) -> None:
        """Load new full weights and drop cached prefixes. In-process they are consumed lazily,
        one at a time. An engine in its own process reads them from a private file streamed
        here (``engines.vllm.weight_file``: header from ``meta`` [(name, dtype, shape)] in the
        iteration order, then one tensor at a time), so neither process holds the whole model
        twice."""
        is_cpu = self.acc.kind == "cpu"
        if self.own_process:
            if meta is None:
                raise ValueError(
                    "an engine in its own process loads weights from a file whose header needs meta=[(name, dtype, "
                    "shape)]"
                )
            path = self.handoff.path_for(handoff.update_bytes(meta))
            try:
                weight_file.write(str(path), meta, iter(weights))
                self.llm.collective_rpc("load_weights_file", args=(str(path), is_cpu))
            finally:
                path.unlink(missing_ok=True)
        else:
            self.llm.collective_rpc(
                "reload_in_config", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            self.llm.collective_rpc("after_reload", args=(is_cpu,))
        self.llm.reset_prefix_cache()
        self.weights_current = True

    @property
    def serves_adapters(self) -> bool:
        return self.adapters is not None

    @property
    def adapters_stale(self) -> bool:
        return self.adapters is not None and self.adapters.stale

    def update_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        """Through vLLM's LoRA requests (``engines.vllm.adapter_sync``)."""
        self.adapters.publish(adapters, self.llm)
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

    @property
    def holds_policy(self) -> bool:
        """The weights, and with LoRA adapter sync the published adapters."""
        return self.weights_current and (self.adapters is None or self.adapters.request is not None)

    def sleep(self, discard_weights: bool = False) -> None:
        """Release the device: vLLM sleep level 1 (weights backed up to host, KV cache dropped),
        or level 2 with ``discard_weights`` (both dropped: no host copy and no copy back on a
        wake that a weight load overwrites anyway). vLLM has no sleep mode on CPU: nothing
        happens there."""
        if self.acc.kind != "cpu" and not self._asleep:
            self.llm.sleep(level=2 if discard_weights else 1)
            self._asleep = True
            self.weights_current = self.weights_current and not discard_weights
            if self.adapters is not None:  # vLLM may drop its LoRA buffers (verl #7434): publish again after the wake
                self.adapters.stale = True

    def wake_weights(self) -> None:
        """Bring back the weights only (the KV cache stays released until ``wake_kv_cache``);
        after a level-2 sleep they are unset memory until ``update_weights``."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def resident(self) -> bool:
        """Whether the weights and KV cache hold device memory now (always on CPU: no sleep mode)."""
        return not self._asleep
