"""The methods this project adds to vLLM's worker (``worker_extension_cls``): weight loading
(``weight_receiver``) and routing capture (``route_capture``)."""

from __future__ import annotations

from spmd_rl.engines.vllm.route_capture import RouteCapture
from spmd_rl.engines.vllm.weight_receiver import WeightReceiver


class RolloutWorker(WeightReceiver, RouteCapture):
    pass
