"""The committed tiny-model weights (``tools/tiny_weights.py``): each file is what its builder
trains (the builder's current arguments and first steps reproduce the file's record), the
folders the setup builds hold those weights exactly, and a folder built from other weights is
built again."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import tiny_weights  # noqa: E402  (tools/ is not a package)

FIXTURE = {
    "tiny-qwen2": "tiny_model",
    "tiny-qwen2-reward": "tiny_reward_model",
    "tiny-tools": "tiny_tools",
    "tiny-agent": "tiny_agent",
    "tiny-qwen3-moe": "tiny_moe",
}


@pytest.mark.parametrize("name", list(tiny_weights.ASSETS))
def test_each_committed_file_is_what_its_builder_trains(request, name):
    """The builder's arguments today are those that trained the file, and its first steps'
    losses are the recorded ones within 1e-3 (float32 on another CPU or thread count differs by
    about 1e-6; a 5 % change of the learning rate alone moves the fifth loss by 6e-3, a changed
    model, task or sampling order moves the first)."""
    request.getfixturevalue(FIXTURE[name])  # the reward model's steps start from the committed policy
    asset = tiny_weights.ASSETS[name]
    record = tiny_weights.recorded(asset)
    assert record["args"] == tiny_weights.builder_args(asset, REPO / "assets"), "run tools/tiny_weights.py rebuild"
    got = tiny_weights.first_losses(asset, REPO / "assets")
    assert got == pytest.approx(record["first_losses"], rel=1e-3), "run tools/tiny_weights.py rebuild"
    assert len(got) == tiny_weights.FIRST_STEPS and got[-1] < got[0]  # it trains


@pytest.mark.parametrize("name", list(tiny_weights.ASSETS))
def test_the_built_folder_holds_the_committed_weights_in_float32(request, name):
    folder = request.getfixturevalue(FIXTURE[name])
    asset = tiny_weights.ASSETS[name]
    half, full = load_file(asset.weights), load_file(folder / "model.safetensors")
    assert set(half) == set(full)
    assert all(full[k].dtype == torch.float32 and torch.equal(full[k], half[k].float()) for k in half)
    report = json.loads((folder / asset.done).read_text())
    assert report["weights_sha256"] == tiny_weights.sha256(asset.weights)
    steps = "steps" if asset is tiny_weights.REWARD else "sft_steps"
    assert report[steps] == tiny_weights.recorded(asset)["report"][steps]


def test_a_folder_from_other_weights_is_stale(tmp_path):
    asset = tiny_weights.POLICY
    assert not tiny_weights.current(asset, tmp_path)  # missing
    asset.path(tmp_path).mkdir(parents=True)
    done = asset.path(tmp_path) / asset.done
    done.write_text(json.dumps({"sft_steps": 530}))  # trained here, before the weights were committed
    assert not tiny_weights.current(asset, tmp_path)
    done.write_text(json.dumps({"weights_sha256": tiny_weights.sha256(tiny_weights.MOE.weights)}))
    assert not tiny_weights.current(asset, tmp_path)
    done.write_text(json.dumps({"weights_sha256": tiny_weights.sha256(asset.weights)}))
    assert tiny_weights.current(asset, tmp_path)


def test_weights_of_another_model_are_refused():
    import make_tiny_model

    model = make_tiny_model.build_model(make_tiny_model.build_tokenizer(), 0)
    with pytest.raises(SystemExit, match="does not hold this builder's model.*tiny_weights.py rebuild"):
        make_tiny_model.load_weights(model, tiny_weights.MOE.weights)


@pytest.mark.parametrize("name", sorted(tiny_weights.FLOORS))
def test_each_committed_warm_start_measures_at_least_its_floor(name):
    """The committed record of a warm start with a floor meets it (``tiny_weights.FLOORS``): the
    tool model packed from a 2-core AVX2 EPYC's build copied the tool's answer 0.325 of the time
    and its quickstart barely learned; ``pack`` now refuses such a build, and this refuses the
    committed file."""
    report = tiny_weights.recorded(tiny_weights.ASSETS[name])["report"]
    for key, floor in tiny_weights.FLOORS[name].items():
        assert report[key] >= floor, f"{name}: {key} {report[key]} < {floor}"
