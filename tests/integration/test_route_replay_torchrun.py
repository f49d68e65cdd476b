"""Rollout routing replay end to end: 2 ranks under torchrun, real etcd, in-process vLLM, the
tiny Qwen3-MoE on FSDP, with partial rollout (responses carried across iterations) and two PPO
epochs (an old-log-prob pass that replays too), with both router terms in the objective
(their values logged every update).

Observed, not constructed: the dump plan (tests/helpers/faults) saves every route table as the
rollout engine took it from vLLM's worker, keyed by the request's token context, and every
sequence batch a stage built from what it read from the dock. Each sample a stage read must
hold, bit for bit, the rows vLLM returned for the segment that sampled each of its tokens: a
route column that lost a segment, re-used the last segment's recomputed rows, shifted rows or
crossed samples fails."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.recipe.estimates import routes_bytes
from tests.dock_dump import dump_env
from tests.trainer_util import train

MOE = (
    "model.path=assets/tiny-qwen3-moe",
    "actor.moe.router_replay=rollout",
    "stream.partial_tokens=3",
    "actor.ppo_epochs=2",
    "actor.correction.tis_cap=2.0",
    "trainer.iterations=4",
    "actor.optim.lr=0.02",
    "actor.loss.entropy_coef=0.5",
    "actor.moe.aux_loss_coef=0.01",
    "actor.moe.z_loss_coef=0.001",
)  # large steps even where every reward is equal: a continuation's recomputed routes differ


def segments(records: list[dict]) -> dict[tuple[int, ...], list[tuple[int, torch.Tensor]]]:
    """vLLM's returns by request context: [(sampled tokens ..., routes)] per context."""
    out: dict[tuple[int, ...], list] = {}
    for rec in records:
        for resp, routes in zip(rec["responses"], rec["routes"]):
            out.setdefault(tuple(rec["context"]), []).append((tuple(resp), routes))
    return out


def segments_of(
    prompt: list[int], response: list[int], routes: torch.Tensor, by_context: dict, row: int
) -> tuple[int, bool]:
    """Walk the sample's segments: the one that continued after m response tokens routed the
    context and sampled tokens m.. from position P + m - 1 on, so the sample's rows from there
    to its last sampled token must be that table's rows from there (the first segment: all of
    them). Returns (how many segments the sample took, whether a later segment's recomputed
    rows of earlier positions differ from the ones kept: the check could tell them apart)."""
    got, seq, m, count, telling = routes.numpy().tobytes(), prompt + response, 0, 0, False
    while m < len(response):
        first = 0 if m == 0 else len(prompt) + m - 1
        options = [
            (r, t.numpy().tobytes()[first * row :])
            for r, t in by_context.get(tuple(seq[: len(prompt) + m]), [])
            if r and list(r) == response[m : m + len(r)]
        ]
        match = [r for r, new in options if got[first * row : first * row + len(new)] == new]
        assert match, (
            f"after {m} response tokens: the trainer's routes are not what vLLM returned ({len(options)} candidate "
            f"requests)"
        )
        if m:
            whole = [
                t.numpy().tobytes()[: first * row]
                for r, t in by_context[tuple(seq[: len(prompt) + m])]
                if r == match[0]
            ]
            telling |= any(w != got[: first * row] for w in whole)
        m, count = m + len(match[0]), count + 1
    return count, telling


@pytest.mark.slow
def test_the_trainer_reads_the_routes_vllm_returned_across_carries(request, tiny_model, tmp_path, etcd):
    request.getfixturevalue("tiny_moe")
    folder = tmp_path / "dump"
    rows = train(tmp_path, "r3", etcd.endpoint, *MOE, extra_env=dump_env(folder))
    # the first iteration trains samples of the weights it sampled with (float32 vLLM and trainer:
    # the same experts, but where a near-tie flips); later ones carry segments of older weights
    assert rows[0]["router_agreement"] > 0.99 and rows[0]["routes_differ_tokens"] < 0.05, rows[0]
    updated = [r for r in rows if "loss" in r]  # an iteration where no group finished trains nothing
    assert len(updated) >= 2 and all("router_agreement" in r for r in updated), rows
    for r in updated:
        assert 0.0 < r["router_agreement"] <= 1.0 and 1.0 <= r["expert_load_max_mean"] <= 4.0, r
        assert 0.5 < r["moe_aux_loss"] < 4.0 and r["moe_z_loss"] > 0.0, (
            r
        )  # Switch's term is 1 under uniform load, E at most
    by_context = segments([torch.load(f, weights_only=True) for f in sorted(folder.glob("vllm_routes_rank*_*.pt"))])
    row = 4 * 2  # layers x experts per token
    reads = [torch.load(f, weights_only=True) for f in sorted(folder.glob("read_routes_rank*_*.pt"))]
    assert reads, "no stage read routes"
    carried = checked = telling = 0
    for rec in reads:
        for p, resp, routes in zip(rec["prompts"], rec["responses"], rec["routes"]):
            prompt, response = p.tolist(), resp.tolist()
            assert routes.numel() == (len(prompt) + len(response) - 1) * row
            count, differs = segments_of(prompt, response, routes, by_context, row)
            carried, telling, checked = carried + (count > 1), telling + differs, checked + 1
    assert checked >= 2 * 8 * 4 and carried > 0 and telling > 0, (checked, carried, telling)  # both passes' reads
    written = {}
    for f in folder.glob("put_rank*_*.pt"):
        rec = torch.load(f, weights_only=True)
        if "rollout_routes" in rec["columns"]:
            written[rec["iteration"]] = written.get(rec["iteration"], 0) + sum(
                t.numel() for t in rec["columns"]["rollout_routes"]
            )
    bound = routes_bytes(8, 4, 32, 8, 4, 2, reads=0)  # the write; the quickstart's G, N, PL, SL (trainer_util)
    print(f"rollout_routes written per iteration: {sorted(written.values())} bytes; formula bound {bound}")
    assert written and all(0 < b <= bound for b in written.values()), (written, bound)
