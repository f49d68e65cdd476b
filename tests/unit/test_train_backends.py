"""``recipe.train_backends``: ``validate`` accepts exactly the registered backends (the table is
the one list: the schema takes any name), each names an engine class with the one
``from_config`` signature, and what ``validate`` and ``plan`` say about a backend comes from its
object: a backend registered here with its own rules, memory model, description and replica
support is what they print, with no other edit (no schema ``Literal`` to extend)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from types import SimpleNamespace

from spmd_rl.catalog import user_function
from spmd_rl.config.errors import Violation
from spmd_rl.recipe.estimates import RankMemory
from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.recipe.plan import render
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.train_backends import TRAIN_BACKENDS, TrainBackend, role_bytes
from tests.conftest import REPO


def test_validate_names_the_registered_backends_and_each_engine_has_one_constructor():
    cfg = load_config(REPO / "configs/quickstart.yaml", ["actor.backend=nope"])
    assert [str(v) for v in check(cfg)[1]] == [
        "actor.backend='nope': not a registered training backend -> use one of fsdp, megatron"
    ]
    signatures = set()
    for backend in TRAIN_BACKENDS.values():
        engine = user_function(backend.engine, f"backend {backend.name}")
        signatures.add(tuple(inspect.signature(engine.from_config).parameters))
    assert signatures == {("cfg", "acc", "mesh", "policy", "role")}


def test_validate_and_plan_read_the_backend_object(tiny_model, monkeypatch):
    toy = TrainBackend(
        "toy",
        "tests.unit.test_train_backends:ToyEngine",
        memory=lambda cfg, arch, lay: RankMemory(
            train_params=3 * 2**30, train_grads=0, train_optim=6 * 2**30, gen_weights=2**30, kv_cache=0, temp_buffer=0
        ),
        reference_numel=lambda cfg, arch, lay: 7,
        keeps_grads=False,
        rules=lambda cfg, arch, train: [Violation("actor.backend", "toy", "a toy refuses", "use a real one")],
        describe=lambda lay: f"toy dp={lay.train.dp}",
        state="no optimizer at all",
        preference_pairs=False,
        elastic_replicas=True,
        roles={"critic": "tests.unit.test_train_backends:toy_critic"},
    )
    monkeypatch.setitem(TRAIN_BACKENDS, "toy", toy)
    base = load_config(REPO / "configs/quickstart.yaml")
    cfg = base.model_copy(update={"actor": base.actor.model_copy(update={"backend": "toy"})})
    lay, problems = check(cfg)
    assert [str(v) for v in problems] == ["actor.backend='toy': a toy refuses -> use a real one"]
    arch = ModelArch.from_folder(tiny_model)
    text = render(cfg, arch, lay, 10.0)
    assert "train toy dp=2" in text and "(float32 master, no optimizer at all)" in text
    assert "params      3.000 GiB" in text and "optimizer      6.000 GiB" in text
    roles = role_bytes(cfg, arch, lay)
    assert roles["actor"] == 9 * 2**30 and roles["ref"] == 7 * 4 and roles["rollout"] == 2**30
    dpo = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"name": "dpo"})})
    assert any(v.field == "actor.backend" and "DPO runs on" in v.problem for v in check(dpo)[1])
    replicas = load_config(
        REPO / "configs/quickstart.yaml", ["actor.backend=toy", "elastic.replicas.count=2", "elastic.replicas.name=a"]
    )
    assert [v.field for v in check(replicas)[1]] == ["actor.backend"]  # its own rule only: replicas are fine


def toy_critic(cfg, acc, mesh, total_steps):
    return ("toy critic", cfg.algorithm.critic_lr, total_steps)


def test_the_backend_builds_every_trained_role_and_validate_refuses_the_ones_it_lacks(tiny_model, monkeypatch):
    """A backend's ``roles`` is what builds the critic and the reward model (``trainer.build``
    names no engine); a role a needed stage uses and the backend lacks is refused by
    ``validate``, naming the backends that build it."""
    from spmd_rl.recipe.graph import Modes, stages_for
    from spmd_rl.trainer import build

    toy = replace(
        TRAIN_BACKENDS.lookup("fsdp"), name="toy", rules=lambda *a: [], roles={"critic": f"{__name__}:toy_critic"}
    )
    monkeypatch.setitem(TRAIN_BACKENDS, "toy", toy)
    base = ["actor.backend=toy", "algorithm.name=ppo", "algorithm.critic_lr=0.25"]
    cfg = load_config(REPO / "configs/quickstart.yaml", base)
    assert check(cfg)[1] == []
    built = []
    monkeypatch.setattr(build, "user_function", lambda path, what: built.append(path) or _builder_of(path))
    roles = build.build_roles(cfg, Modes.of(cfg), None, None, stages_for(cfg))
    assert roles["critic"] == ("toy critic", 0.25, build.total_steps(cfg)) and built[-1] == f"{__name__}:toy_critic"
    judged = load_config(
        REPO / "configs/quickstart.yaml", [*base, "reward.kind=model", f"reward.model_path={tiny_model}/reward_model"]
    )
    assert [str(v) for v in check(judged)[1]] == [
        "actor.backend='toy': reward.kind needs a reward model (a score model), which the toy backend does not "
        "build -> use reward.kind: rule, or actor.backend: fsdp"
    ]


def _builder_of(path):
    """The actor's engine as a stub (its class is FSDP's, not built here); any role builder as named."""
    if path.endswith(":TrainEngine"):
        return SimpleNamespace(from_config=lambda *a, **k: SimpleNamespace(model=None))
    return user_function(path, "test")
