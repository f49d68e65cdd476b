"""Rollout routing capture: the experts vLLM's MoE routers chose for every token it computed,
kept per request and position (worker-side, a ``worker_extension_cls`` mixin).

vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from Model Runner V2,
which needs Triton; the V1 runner (CPU, and GPUs without Triton) has none. Every router still
calls ``BaseRouter.capture_fn(topk_ids)`` with the logical expert ids of the tokens of the
current forward, in the runner's flattened order: request ``input_batch.req_ids[i]`` owns the
next ``num_scheduled_tokens[req]`` rows. The runner's ``positions`` say where in its sequence
each row is, so chunked prefill and decode steps write the same per-request table:

    routes[req][pos, layer, :] = top-k expert ids of token ``pos`` of request ``req``

Positions 0 .. len(prompt + response) - 2 are computed (the last sampled token is never fed
back), provided no prompt block came from the prefix cache: the rollout engine turns prefix
caching off while routes are recorded. Ids are uint8 (uint16 beyond 256 experts): one row costs
layers x top_k bytes.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch


class RouteCapture:
    def start_routes(self) -> int:
        """Bind the capture to every MoE router of this worker's model and wrap the runner's
        forward; returns the number of routed layers. Idempotent."""
        runner = self.model_runner
        if getattr(runner, "_route_tables", None) is not None:
            return runner._route_layers
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        layers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if not layers or not all(isinstance(m.router, BaseRouter) for m in layers):
            raise RuntimeError("routing capture found no vLLM MoE router (BaseRouter) in the rollout model")
        runner._route_tables, runner._route_lengths = {}, {}
        runner._route_layers = len(layers)
        runner._route_step, runner._route_scheduled = {}, {}
        for m in layers:
            m.router.set_capture_fn(partial(_capture, runner._route_step, int(m.layer_id)))
        inner_forward, inner_execute = runner._model_forward, runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            runner._route_scheduled = dict(scheduler_output.num_scheduled_tokens)
            return inner_execute(scheduler_output, *args, **kwargs)

        def model_forward(*args, positions=None, **kwargs):
            runner._route_step.clear()
            out = inner_forward(*args, positions=positions, **kwargs)
            _scatter(runner, positions)
            return out

        runner.execute_model, runner._model_forward = execute_model, model_forward
        return len(layers)

    def take_routes(self, req_ids: list[str]) -> dict[str, np.ndarray]:
        """The route tables of these internal request ids ([positions, layers, top_k] uint8 or
        uint16), removed from the worker; a request that computed no token gets an empty one."""
        runner = self.model_runner
        empty = np.zeros((0, runner._route_layers, 0), np.uint8)
        return {r: runner._route_tables.pop(r, empty)[: runner._route_lengths.pop(r, 0)] for r in req_ids}

    def drop_routes(self) -> None:
        """Forget every table: the rollout engine calls it before each batch of requests, so
        the tables of requests that never finished (an aborted generation) do not pile up."""
        self.model_runner._route_tables.clear()
        self.model_runner._route_lengths.clear()


def _capture(step: dict[int, torch.Tensor], layer: int, topk_ids: torch.Tensor) -> None:
    step[layer] = topk_ids.detach().to("cpu", copy=True)


def _scatter(runner, positions: torch.Tensor | None) -> None:
    """Write this forward's captured rows into the per-request tables (module docstring)."""
    step, n_layers = runner._route_step, runner._route_layers
    if not step or positions is None:
        return
    if len(step) != n_layers:
        raise RuntimeError(f"routing capture saw {len(step)} of {n_layers} MoE layers in one forward")
    ids = torch.stack([step[i] for i in sorted(step)], dim=1).numpy()  # [rows, layers, k]
    pos = positions.detach().to("cpu").numpy()
    dtype = np.uint8 if int(ids.max(initial=0)) < 256 else np.uint16
    row = 0
    for req in runner.input_batch.req_ids:
        n = runner._route_scheduled.get(req, 0)
        if n == 0:
            continue
        p = pos[row : row + n]
        table = runner._route_tables.get(req)
        need = int(p.max()) + 1
        if table is None or table.shape[0] < need:
            grown = np.zeros((max(need, 2 * (0 if table is None else table.shape[0])), n_layers, ids.shape[2]), dtype)
            if table is not None:
                grown[: table.shape[0]] = table
            table = grown
        table[p] = ids[row : row + n]
        runner._route_tables[req] = table
        runner._route_lengths[req] = max(runner._route_lengths.get(req, 0), need)
        row += n
