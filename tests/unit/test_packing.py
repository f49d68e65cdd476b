"""Padding-free micro-batches (``engines.fsdp.packing``): the layout keeps every sample whole and
apart, and the packed forward gives the padded forward's log-probs, entropies and gradients,
checked against a float64 HF forward; ``actor.pack_sequences`` really changes what the model
sees and nothing it learns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.base import local
from spmd_rl.engines.training.logprobs import build_batch, lm_response_logprobs, split
from spmd_rl.engines.fsdp.packing import pack, packed_response_logprobs, packed_scores, packed_values, place
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.engines.fsdp.engine import TrainEngine


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=24))
def test_every_sample_gets_its_own_span_in_a_row_as_wide_as_the_longest(lengths):
    width, where = place(lengths)
    assert width == max(lengths)
    spans: dict[int, list[tuple[int, int]]] = {}
    for (row, off), n in zip(where, lengths):
        assert 0 <= off and off + n <= width
        spans.setdefault(row, []).append((off, off + n))
    assert sorted(spans) == list(range(len(spans)))  # no empty row
    for row in spans.values():
        row.sort()
        assert all(a[1] <= b[0] for a, b in zip(row, row[1:]))  # disjoint
    # first fit decreasing: a row is opened only when no open row has room, so any two rows
    # together hold more than one row can
    loads = [sum(e - s for s, e in row) for row in spans.values()]
    assert all(a + b > width for i, a in enumerate(loads) for b in loads[i + 1 :])


def test_packing_fills_rows_and_restarts_positions():
    b = build_batch(
        [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9])],
        [torch.tensor([11, 12, 13, 14]), torch.tensor([15]), torch.tensor([16])],
        0,
    )
    p = pack(b)  # lengths 6, 2, 3 -> one row of 6 and one of 2 + 3
    assert p.input_ids.tolist() == [[5, 6, 11, 12, 13, 14], [8, 9, 16, 7, 15, 5]]
    assert p.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 0, 1, 2],
    ]  # the free tail (any id) continues the last sample
    assert p.targets.tolist() == [11, 12, 13, 14, 15, 16]
    assert p.flat_predictor.tolist() == [1, 2, 3, 4, 9, 7]
    assert p.last.tolist() == [5, 10, 8]


def _long_tail_batch(vocab: int, n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [
        torch.randint(3, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g) for _ in range(n)
    ]
    return build_batch(prompts, responses, 0)


def test_a_flash_attention_model_gets_every_sample_in_one_row(tiny_model):
    """HF's flash path sees packed samples only in a one-row batch: the layout for a flash model
    is one row whose positions restart at every sample (its varlen boundaries)."""
    from spmd_rl.engines.fsdp import packing

    b = build_batch(
        [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9])],
        [torch.tensor([11, 12, 13, 14]), torch.tensor([15]), torch.tensor([16])],
        0,
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model), attn_implementation="eager")
    assert not packing.flash_attention(model) and packing.packed_for(model, b).input_ids.shape[0] == 2
    model.config._attn_implementation = "flash_attention_2"
    p = packing.packed_for(model, b)
    assert p.input_ids.tolist() == [[5, 6, 11, 12, 13, 14, 8, 9, 16, 7, 15]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]]


@pytest.mark.parametrize("temperature,one_row", [(1.0, False), (0.7, False), (1.0, True)])
def test_packed_logprobs_entropies_and_grads_equal_the_padded_forward(tiny_model, temperature, one_row, monkeypatch):
    from spmd_rl.engines.fsdp import packing

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").float()
    model.config.use_cache = False
    batch = _long_tail_batch(model.config.vocab_size)
    assert pack(batch).input_ids.shape[0] < len(batch)  # really packed
    monkeypatch.setattr(packing, "flash_attention", lambda m: one_row)  # the flash layout, through SDPA's packed mask

    def run(f, m):
        m.zero_grad()
        lp, ent = f(m, batch.trim(), True, SamplingPolicy(temperature))
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    lp, ent, grads = run(packed_response_logprobs, model)
    lp_pad, ent_pad, grads_pad = run(lm_response_logprobs, model)
    # float32 round-off, packed vs padded SDPA/matmul shapes: measured max 8.6e-6 (0.34 of atol + rtol|x|)
    assert torch.allclose(lp, lp_pad, atol=1e-5) and torch.allclose(ent, ent_pad, atol=1e-5)
    for n in grads:
        # float32 gradients, eps 6e-8 x ~100 accumulations relative to each tensor's max; measured 0.16-0.24 of it
        assert (grads[n] - grads_pad[n]).abs().max() <= 1e-5 * grads_pad[n].abs().max() + 1e-8, n  # float rounding
    assert (lp[~batch.trim().mask] == 0).all() and (lp[batch.trim().mask] < 0).all()
    ref, ref_ent, _ = run(lm_response_logprobs, model.double())  # independent reference: a float64 trunk, padded
    for got, pad, want in ((lp, lp_pad, ref), (ent, ent_pad, ref_ent)):  # packing adds no error to float32's own
        # float32 vs float64: packing may add at most the padded forward's own error again (+1e-6); measured 0.48
        assert (got - want).abs().max() <= 2 * (pad - want).abs().max() + 1e-6
    lp64, _, _ = run(packed_response_logprobs, model)  # float64 trunk packed: the float32 log-softmax's rounding apart
    # float64 trunks, logits rounded to float32 in token_logprob: <= 1 ulp of |lp| (1e-6 at 8-16) + rtol 1e-5
    assert torch.allclose(lp64, ref, atol=1e-6)


@pytest.mark.usefixtures("world_of_one")
def test_pack_sequences_changes_what_the_model_sees_and_not_the_step(tiny_model):
    """actor.pack_sequences acts: the packed engine's forward gets fewer rows; the log-probs,
    the gradient norm and AdamW's first moment ((1 - beta1) g, no clipping) of one step from
    the same weights on the same loss are the same either way, up to float rounding."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    batch = _long_tail_batch(AutoConfig.from_pretrained(tiny_model).vocab_size, n=8, seed=3)
    out = {}
    for packed in (True, False):
        cfg = ActorConfig(
            mini_batch_size=1, micro_batch_size=4, optim={"lr": 1e-3, "grad_clip": 1e6}, pack_sequences=packed
        )
        e = TrainEngine(tiny_model, detect("cpu"), mesh, cfg, "float32", total_steps=10, policy=SamplingPolicy(0.8))
        rows = []
        hook = e.model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[0]))
        lp, _ = e.infer(split(batch, 4))
        step = e.train_step(
            [batch[:4], batch[4:]], lambda lp, ent, k: -(lp.sum() + 0.1 * ent.sum()) / 100, with_entropy=True
        )
        hook.remove()
        moments = torch.cat([local(s["exp_avg"]).flatten() for s in e.optimizer.state.values()])
        out[packed] = lp, rows, step["grad_norm"], moments
    assert sum(out[True][1]) < sum(out[False][1]) == 4 * len(out[False][1])
    # float32 round-off of packed vs padded shapes, as in the forward test above; measured bit-equal here
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    # float32 round-off: a norm of ~8e5 gradient elements from other shapes; measured rel 7e-8
    assert out[True][2] == pytest.approx(out[False][2], rel=1e-5)
    # float32: exp_avg = (1 - beta1) g elementwise, g from other shapes; measured 5.6e-8 of the max
    assert (out[True][3] - out[False][3]).abs().max() <= 1e-5 * out[False][3].abs().max()


def test_packed_values_and_their_grads_equal_the_padded_value_head(tiny_model):
    """The critic's head: V[b, j] = score(h[b, P_b + j - 1]) on the packed rows equals the
    padded forward's, gradients included."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_labels, config.classifier_dropout = 1, 0.0  # as engines.training.hf_weights builds the critic
    model = AutoModelForTokenClassification.from_pretrained(tiny_model, config=config).float()
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a checkpoint's head; a fresh critic's is zero
    batch = _long_tail_batch(model.config.vocab_size, seed=5).trim()

    def run(packed: bool):
        model.zero_grad()
        if packed:
            v = packed_values(model, batch)
        else:
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            v = out[..., 0].float().gather(1, batch.predictor) * batch.mask
        (v**2).sum().backward()
        return v.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (v, g), (v_pad, g_pad) = run(True), run(False)
    # float32 round-off of the trunk in packed vs padded shapes on |v| ~ 1; measured 1.9e-6
    assert v.abs().max() > 0.1 and torch.allclose(v, v_pad, atol=1e-5)
    for n in g:
        # float32 gradients, eps 6e-8 x ~100 accumulations relative to each tensor's max; measured 0.19 of it
        assert (g[n] - g_pad[n]).abs().max() <= 1e-5 * g_pad[n].abs().max() + 1e-8, n


def test_packed_scores_equal_the_padded_reward_model(tiny_model):
    """The reward model's score at each sample's last token: packed (several samples per row)
    equals the padded forward read at the last real token."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, config=config).float()
    batch = _long_tail_batch(model.config.vocab_size, seed=7).trim()
    assert pack(batch).input_ids.shape[0] < len(batch)
    seen = []
    hook = model.score.register_forward_hook(lambda _m, _i, out: seen.append(out))
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    hook.remove()
    last = batch.attention_mask.sum(1) - 1
    want = seen[0][torch.arange(len(batch)), last, 0]
    got = packed_scores(model, batch)
    assert got.shape == (len(batch),) and want.abs().max() > 0.01
    # float32 round-off of packed vs padded shapes; measured 6e-8 on scores ~ 0.1-1
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.usefixtures("world_of_one")
def test_the_step_reads_its_loss_on_the_host_once_whatever_the_micro_batches(tiny_model, monkeypatch):
    """On a device each ``float(tensor)`` or ``.item()`` waits for the queued kernels: the
    step reads the loss once after its last backward, not once per micro-batch. Counted on
    the Tensor methods for 1 and 4 micro-batches of the same 8 samples; the summed loss is
    the same."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    batch = _long_tail_batch(AutoConfig.from_pretrained(tiny_model).vocab_size, n=8, seed=5)
    reads, losses = {}, {}
    for n in (1, 4):
        e = TrainEngine(
            tiny_model,
            detect("cpu"),
            mesh,
            ActorConfig(mini_batch_size=1, micro_batch_size=8 // n, optim={"lr": 1e-3}),
            "float32",
            total_steps=10,
            policy=SamplingPolicy(1.0),
        )
        count = [0]
        for name in ("__float__", "item"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(
                torch.Tensor, name, lambda t, _real=real: (count.__setitem__(0, count[0] + 1), _real(t))[1]
            )
        step = e.train_step(split(batch, 8 // n), lambda lp, ent, k: -lp.sum() / 100)
        monkeypatch.undo()
        reads[n], losses[n] = count[0], step["loss"]
    assert reads[4] == reads[1], reads
    # float32: the same per-token losses summed in 1 or 4 micro-batches (padded to other widths); measured rel 6e-8
    assert losses[4] == pytest.approx(losses[1], rel=1e-5)
