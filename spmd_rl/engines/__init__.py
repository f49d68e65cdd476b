"""The engines behind the roles' protocols (``base``: ``Engine`` for the training roles,
``Rollout`` for generation): one folder per engine (``fsdp`` and ``megatron`` train, ``vllm`` and
``hf`` generate), ``training`` for what the two training engines share (log-probs, LoRA,
weights, the LR schedule, routing replay, the DCP reader), and ``rollouts``, the builder of the
rollout engine ``rollout.engine`` names (part of the protocol: it names no engine folder)."""
