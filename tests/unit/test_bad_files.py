"""Files that are not what their names say: one line naming the file, exit 2, no traceback."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.data.files import BadFile, read_jsonl, read_parquet

QUICK = "configs/quickstart.yaml"


def _validate(*args):
    return CliRunner().invoke(app, ["validate", *args])


def test_config_that_is_not_utf8(tmp_path, in_repo):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00model: x\n")
    res = _validate(str(bad))
    assert res.exit_code == 2 and "not UTF-8 text" in res.output and str(bad) in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "name,content,problem",
    [
        ("garbage.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00", "the first line is not a UTF-8 JSON object"),
        ("list.jsonl", b"[1, 2]\n", "the first line is not a JSON object"),
        ("empty.jsonl", b"\n\n", "empty file"),
        ("fake.parquet", b"a,b\n1,2\n", "not a parquet file"),
    ],
)
def test_dataset_that_is_not_what_its_name_says(tmp_path, in_repo, tiny_model, name, content, problem):
    path = tmp_path / name
    path.write_bytes(content)
    res = _validate(QUICK, f"data.train_path={path}")
    assert res.exit_code == 2 and f"data.train_path='{path}': {problem}" in res.output, res.output


def test_bad_row_deep_in_a_file_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": \xff}\n')
    with pytest.raises(BadFile, match="line 3"):
        read_jsonl(path)
    fake = tmp_path / "x.parquet"
    fake.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")  # passes the sniff, fails the read
    with pytest.raises(BadFile, match="not a readable parquet file"):
        read_parquet(fake)


def test_truncated_safetensors(tmp_path, in_repo, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    res = _validate(QUICK, f"model.path={model}")
    assert res.exit_code == 2 and "model.safetensors: truncated" in res.output, res.output
    weights.write_bytes(b"\x01\x02")
    assert "shorter than a safetensors header" in _validate(QUICK, f"model.path={model}").output
