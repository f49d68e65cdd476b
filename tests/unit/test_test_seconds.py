"""tools/test_seconds.py maps a JUnit report's classnames to the test files under tests/unit and
tests/integration, summing setup, call and teardown; a report from elsewhere is refused."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("test_seconds_tool", REPO / "tools/test_seconds.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def report(tmp_path, *cases: tuple[str, float]):
    body = "".join(f'<testcase classname="{c}" name="t" time="{t}"/>' for c, t in cases)
    path = tmp_path / "run.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_classnames_map_to_files_in_either_folder(tmp_path):
    got = tool.file_seconds(
        report(
            tmp_path,
            ("tests.unit.test_a", 1.25),
            ("tests.unit.test_a", 2.0),
            ("tests.integration.test_b.TestGroup", 7.0),
            ("tests.test_c", 0.5),
        )
    )
    assert got == {"tests/integration/test_b.py": 7.0, "tests/unit/test_a.py": 3.2, "tests/test_c.py": 0.5}
    assert list(got) == ["tests/integration/test_b.py", "tests/unit/test_a.py", "tests/test_c.py"]


def test_a_report_from_elsewhere_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="is not tests"):
        tool.file_seconds(report(tmp_path, ("other.test_x", 1.0)))
