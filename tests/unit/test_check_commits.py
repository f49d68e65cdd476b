"""``tools/check_commits.py``: the subject rule, and the script's exit status on a real repository."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tools.check_commits import problems


def test_a_subject_is_area_colon_summary_in_72_characters_then_a_blank_line():
    assert problems("elastic: liveness from leases\n\nsoak: 33/38 -> 0/3 unexplained losses\n") == []
    assert problems("docs, test: one line") == []
    too_long = "elastic: " + "x" * 64
    assert len(too_long) == 73 and "73 characters" in problems(too_long)[0]
    assert problems("Fix the quorum") and problems("elastic:no space") and problems("Elastic: capital area")
    assert problems("elastic: summary\nbody without a blank line") == ["no blank line between the subject and the body"]


def _commit(repo, message: str) -> None:
    (repo / "f").write_text(message)
    subprocess.run(["git", "add", "f"], cwd=repo, check=True)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "commit", "-qm", message], cwd=repo, check=True, env=env)


def test_the_script_fails_on_a_bad_subject_in_the_history_and_names_it(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    script = [sys.executable, str(REPO / "tools/check_commits.py")]
    _commit(tmp_path, "dock: a good subject")
    assert subprocess.run(script, cwd=tmp_path).returncode == 0
    _commit(tmp_path, "a subject that says everything in one line " * 3)
    done = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1 and "128 characters" in done.stderr, done.stderr
