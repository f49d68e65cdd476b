"""The terminal filter of vLLM's chatter (``engines.vllm.logs``) drops exactly what it names,
and what it names is true of a real engine (``test_rollout_engine``). That a real run's terminal
shows no vLLM chatter and one line per iteration is checked on the run of
``test_runtime_fields_torchrun.py`` (``test_a_run_terminal_shows_no_vllm_chatter``)."""

from __future__ import annotations

import logging

from spmd_rl.engines.vllm.logs import EXPECTED, RELOAD_LOGGER, RELOAD_MISS, TerminalFilter


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
