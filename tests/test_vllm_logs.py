"""The terminal filter of vLLM's chatter (``engines.vllm_logs``) drops exactly what it names,
and what it names is true of a real engine (``test_rollout_engine``). A real run's terminal
shows no vLLM chatter and one line per iteration."""

from __future__ import annotations

import logging

import pytest

from spmd_rl.engines.vllm_logs import EXPECTED, RELOAD_LOGGER, RELOAD_MISS, TerminalFilter
from tests.trainer_util import train


def _record(name: str, level: int, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_the_filter_drops_only_the_named_chatter():
    f = TerminalFilter()
    assert not f.filter(_record(RELOAD_LOGGER, logging.WARNING, RELOAD_MISS, "ParallelLMHead"))
    assert not f.filter(_record(RELOAD_LOGGER, logging.WARNING, RELOAD_MISS, "RotaryEmbedding"))
    assert f.filter(_record(RELOAD_LOGGER, logging.WARNING, RELOAD_MISS, "QKVParallelLinear"))  # a real failure shows
    assert not f.filter(_record("vllm.platforms.cpu", logging.INFO, "anything at INFO"))
    assert f.filter(_record("vllm.platforms.cpu", logging.ERROR, "an error"))
    assert f.filter(_record("vllm.config.model", logging.WARNING, "max_model_len is greater than the derived length"))
    for name, start, reason in EXPECTED:
        assert reason and not f.filter(_record(name, logging.WARNING, start + " ..."))
        assert f.filter(_record(name + ".other", logging.WARNING, start + " ..."))  # only that logger
    assert f.filter(_record("spmd_rl", logging.INFO, "training from iteration 0"))


@pytest.mark.slow
def test_a_run_terminal_shows_no_vllm_chatter(tiny_model, tmp_path, etcd):
    train(tmp_path, "quiet", etcd.endpoint, "logging.progress=true", "checkpoint.interval=0")
    err = (tmp_path / "quiet/stderr.log").read_text()
    assert "Failed to load weights" not in err and "LD_PRELOAD" not in err and "reduce_op" not in err, err[-3000:]
    assert "vllm" not in err.lower().replace("vllm-rank", ""), err[-3000:]
    assert err.count("iter 1/2 ") == 1 and err.count("iter 2/2 ") == 1
    assert [line for line in err.splitlines() if line.startswith("iter 1/2")][0].endswith("tok/s/dev")  # not wrapped
    logs = sorted(p.name for p in (tmp_path / "quiet/logs").glob("vllm-rank*.log"))
    assert logs == ["vllm-rank0.log", "vllm-rank1.log"]
    assert "Failed to load weights" in (tmp_path / "quiet/logs/vllm-rank0.log").read_text()  # kept in the run folder
