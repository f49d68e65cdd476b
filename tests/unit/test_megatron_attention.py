"""The megatron backend's SDPA core attention (``engines.megatron.attention``) against mcore's
local ``DotProductAttention`` with the explicit [b, 1, s, s] mask it replaced: the same tiny
checkpoints (dense Qwen2 with grouped keys, Qwen3-MoE with q/k norms) in float32 on CPU give the
same logits at every valid position of right-padded rows, and the same gradient of every
parameter. And the memory claim, by the tensors each op makes: SDPA's forward and backward make
none of s² elements, mcore's local module makes its [heads, s, s] scores."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmd_rl.engines.megatron import model as megatron_model
from spmd_rl.engines.megatron.attention import SdpaAttention
from spmd_rl.engines.megatron.engine import _prepare_megatron


@pytest.fixture(scope="module")
def mcore(world_of_one):
    """mcore's groups (TP, PP and EP 1) in this process, patched for the CPU as the engine does."""
    from megatron.core import parallel_state

    _prepare_megatron(torch.device("cpu"), 1, 1, 1)
    yield
    parallel_state.destroy_model_parallel()


def explicit_mask(valid: torch.Tensor) -> torch.Tensor:
    """What the engine passed before: [b, 1, s, s], True = masked: causal, no key past a row's end."""
    s = valid.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    return (causal[None] | ~valid.bool()[:, None, :])[:, None]


def right_padded(vocab: int, lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=g)
    valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    return ids * valid, valid  # pad id 0 past each row's end


def build(path, monkeypatch, core_attention):
    monkeypatch.setattr(megatron_model, "SdpaAttention", core_attention)
    model, _ = megatron_model.build_model(path, torch.float32, torch.float32, tp=1, tp_rank=0)
    return model


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_sdpa_equals_the_local_spec_with_its_explicit_mask(mcore, tiny_model, tiny_moe, monkeypatch, which):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    path = {"dense": tiny_model, "moe": tiny_moe}[which]
    sdpa = build(path, monkeypatch, SdpaAttention)
    local = build(path, monkeypatch, DotProductAttention)
    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SdpaAttention)
    assert type(local.decoder.layers[0].self_attention.core_attention) is DotProductAttention
    ids, valid = right_padded(sdpa.vocab_size, [23, 9, 1, 17], seed=0)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(*ids.shape, sdpa.vocab_size, generator=g) * valid[..., None]

    outs = {}
    for name, m, mask in (("sdpa", sdpa, None), ("local", local, explicit_mask(valid))):
        logits = m(input_ids=ids, position_ids=None, attention_mask=mask)
        # a loss of the valid positions only, as every loss of the engine
        (torch.log_softmax(logits, -1) * weights).sum().backward()
        outs[name] = logits.detach()[valid], {n: p.grad for n, p in m.named_parameters()}
    (got, got_grads), (want, want_grads) = outs["sdpa"], outs["local"]
    # float32: SDPA vs mcore's explicit softmax over <= 23 keys; measured 4.9e-7 of max |logit| (5.8)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert got_grads.keys() == want_grads.keys()
    for n, grad in want_grads.items():
        # float32 gradients through 4 layers, relative to each tensor's max; measured 0.19 (AVX512) and 0.22 (AVX2)
        assert (got_grads[n] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, n


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output had, over what ran inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_makes_no_tensor_of_s_squared_elements(mcore, dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, heads, groups, head_dim = 1024, 4, 2, 32
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 1, heads, head_dim, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, 1, groups, head_dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    largest = {}
    for name, module, mask in (
        ("sdpa", SdpaAttention, None),
        ("local", DotProductAttention, explicit_mask(torch.ones(1, s, dtype=torch.bool))),
    ):
        core = module(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        with LargestTensor() as seen:
            out = core(q, k, v, mask)
            out.float().square().sum().backward()
        assert out.shape == (s, 1, heads * head_dim)
        largest[name] = seen.largest
    assert largest["local"] >= heads * s * s  # the scores the local module makes
    assert largest["sdpa"] <= 4 * s * heads * head_dim  # the inputs' order: no s x s tensor


def test_sdpa_refuses_what_it_does_not_compute(mcore):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention_dropout"):
        SdpaAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    cfg.attention_dropout = 0.0
    with pytest.raises(ValueError, match="attn_mask_type"):
        SdpaAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")
    core = SdpaAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q = torch.zeros(4, 1, 2, 32)
    with pytest.raises(ValueError, match="attention_mask=None"):
        core(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
