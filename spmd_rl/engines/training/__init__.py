"""What the training engines (``fsdp``, ``megatron``) share: the sequence batch and its
per-token log-probs (``logprobs``, ``token_logprob``), the HF safetensors folder and sharded
build (``hf_weights``, ``fused_experts``), the LR schedule, LoRA, MoE routing replay and the
restricted DCP reader (``safe_dcp``)."""
