"""The engine's weight reload runs inside vLLM's config context on every supported release
(issue 70, finding 4): 0.26's ``Worker.reload_weights`` does not enter it, so the worker
extension's ``reload_in_config`` does. The model runner here records the config it sees."""

from __future__ import annotations

import pytest
from vllm.config import VllmConfig, get_current_vllm_config_or_none

from spmd_rl.engines.vllm.weight_receiver import WeightReceiver


class _Runner:
    def __init__(self):
        self.seen = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.seen.append((get_current_vllm_config_or_none(), list(weights_iterator), is_checkpoint_format))


class _Worker(WeightReceiver):
    def __init__(self):
        self.vllm_config, self.model_runner = VllmConfig(), _Runner()


@pytest.mark.vllm_range  # 0.26 is the release whose Worker.reload_weights skips the context
def test_the_reload_sees_the_workers_config_and_leaves_none_behind():
    worker = _Worker()
    assert get_current_vllm_config_or_none() is None
    worker.reload_in_config(iter([("w", 1)]))
    ((config, weights, checkpoint_format),) = worker.model_runner.seen
    assert config is worker.vllm_config and weights == [("w", 1)] and checkpoint_format is True
    assert get_current_vllm_config_or_none() is None
