"""The transformers rollout engine (``rollout.engine: hf``): generation with the model's own
forward and KV cache, where vLLM is not built (a device or an NPU without a vLLM wheel) or not
wanted."""
