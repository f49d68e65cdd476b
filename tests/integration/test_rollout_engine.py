"""The project's VllmRollout on a real vLLM (``tests/helpers/vllm_engine_probe.py``, one engine
for every test here):

- a colocated engine starts from dummy weights and refuses to generate until its first weight
  load; after each load its greedy output equals HF's on the same weights (so the dummy start
  costs nothing but the checkpoint read it skips);
- building it leaves the process's float32 matmul precision as it was (vLLM's worker sets
  "highest" process-wide, which would turn TF32 off for the trainer);
- what the terminal filter (``engines.vllm.logs``) hides is true: vLLM logs the reload misses
  for exactly the tied LM head and the rotary embedding, the head is the embedding's storage
  holding the new weights, and the rotary embedding has no parameters;
- with ``rollout.vllm.enforce_eager`` (the default) generating compiles nothing: vLLM's sampler
  helpers, which it wraps in ``torch.compile`` in every mode, run eagerly (their first-call
  compile was 4.8 s of every engine's first generation on CPU);
- the KV cache vLLM allocates is ``rollout.kv_cache_gib``, fractions of a GiB too;
- in a process that ends through ``teardown.exit_after`` the engine core's shutdown finalizer
  (``compat.core_finalizer``) is found and detached.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_helper


@pytest.fixture(scope="module")
def probe(tiny_model):
    return run_helper("vllm_engine_probe.py", tiny_model)


@pytest.mark.slow
@pytest.mark.vllm_range
def test_a_dummy_start_refuses_to_generate_then_equals_hf_after_each_load(probe):
    assert probe["refused_before_load"] is True, probe
    assert probe["greedy_equals_hf"] == [True] * 3, probe


@pytest.mark.slow
@pytest.mark.vllm_range
def test_building_the_engine_keeps_the_float32_matmul_precision(probe):
    assert probe["precision_after_build"] == "medium", probe


@pytest.mark.slow
@pytest.mark.vllm_range
def test_what_the_filtered_reload_warnings_say_is_true_of_a_real_engine(probe):
    # every layer the reload reports unloaded is one of the two the filter hides (vLLM 0.26 does
    # not report the tied head; 0.32 does), and the rotary embedding always is
    assert "RotaryEmbedding" in probe["misses"] and set(probe["misses"]) <= {"ParallelLMHead", "RotaryEmbedding"}, probe
    assert probe["head_is_embedding"] == [True] * 3 and probe["embedding_is_new"] == [True] * 3, probe
    assert probe["rotary_parameters"] == 0


@pytest.mark.slow
@pytest.mark.vllm_range
def test_an_eager_engine_compiles_nothing_while_it_generates(probe):
    assert probe["compiled_frames"] == 0, probe


@pytest.mark.slow
@pytest.mark.vllm_range
def test_the_kv_cache_is_the_configured_fraction_of_a_gib(probe):
    # vLLM rounds down to whole blocks: at most one block (16 tokens x 2 KB here) under the budget
    assert probe["kv_cache_budget"] - 2**16 <= probe["kv_cache_bytes"] <= probe["kv_cache_budget"], probe


@pytest.mark.slow
@pytest.mark.vllm_range
def test_a_rank_that_ends_through_exit_after_skips_the_engine_shutdown(probe):
    # None: no finalizer where compat looks (vLLM 0.26 keeps none: nothing to skip); False: not detached
    from spmd_rl.engines.vllm import compat

    assert probe["core_finalizer_detached"] is (None if compat.minor(probe["vllm"]) == "0.26" else True), probe
