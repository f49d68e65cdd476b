"""Training engine (FSDP2 + DTensor TP on HF model classes) and rollout engine (in-process vLLM)."""
