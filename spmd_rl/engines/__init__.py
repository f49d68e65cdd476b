"""The engines behind the roles' protocols (``base``: ``Engine`` for the training roles,
``Rollout`` for generation): one folder per engine (``fsdp`` and ``megatron`` train, ``vllm`` and
``hf`` generate) and the helpers they share (log-probs, LoRA, packing, weight files)."""
