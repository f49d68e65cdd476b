"""The vLLM rollout engine (``rollout.engine: vllm``): the engine (``engine.VllmRollout``), the
options it builds vLLM with, the worker methods it adds to vLLM's worker, and what it does about
vLLM's logs, shared memory, LoRA requests and MoE routes. Nothing outside this package imports
vLLM for generation; the trainer reaches it through ``engines.base.Rollout``."""
