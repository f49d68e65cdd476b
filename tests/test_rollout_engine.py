"""The project's RolloutEngine on a real vLLM (``tests/helpers/vllm_engine_probe.py``, one engine
for every test here):

- a colocated engine starts from dummy weights and refuses to generate until its first weight
  load; after each load its greedy output equals HF's on the same weights (so the dummy start
  costs nothing but the checkpoint read it skips);
- building it leaves the process's float32 matmul precision as it was (vLLM's worker sets
  "highest" process-wide, which would turn TF32 off for the trainer);
- what the terminal filter (``engines.vllm_logs``) hides is true: vLLM logs the reload misses
  for exactly the tied LM head and the rotary embedding, the head is the embedding's storage
  holding the new weights, and the rotary embedding has no parameters.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_helper


@pytest.fixture(scope="module")
def probe(tiny_model):
    return run_helper("vllm_engine_probe.py", tiny_model)


@pytest.mark.slow
def test_a_dummy_start_refuses_to_generate_then_equals_hf_after_each_load(probe):
    assert probe["refused_before_load"] is True, probe
    assert probe["greedy_equals_hf"] == [True] * 3, probe


@pytest.mark.slow
def test_building_the_engine_keeps_the_float32_matmul_precision(probe):
    assert probe["precision_after_build"] == "medium", probe


@pytest.mark.slow
def test_what_the_filtered_reload_warnings_say_is_true_of_a_real_engine(probe):
    assert probe["misses"] and set(probe["misses"]) == {"ParallelLMHead", "RotaryEmbedding"}, probe
    assert probe["head_is_embedding"] == [True] * 3 and probe["embedding_is_new"] == [True] * 3, probe
    assert probe["rotary_parameters"] == 0
