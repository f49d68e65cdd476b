"""Record each test file's seconds from a pytest JUnit report, for the suite's scheduling.

``python -m pytest --junitxml=run.xml`` then ``python tools/test_seconds.py run.xml`` rewrites
``tests/file_seconds.json``: {file: seconds summed over its tests (setup, call and teardown)},
largest first. ``tests/conftest.py`` hands files to the pytest-xdist workers in that order
(longest processing time first), so the last file to finish is a short one and both workers
end together; a file missing from the record (a new one) goes last. Re-run after adding slow
tests; the numbers only order files, nothing asserts on them."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "file_seconds.json"


def file_seconds(report: Path) -> dict[str, float]:
    """{tests/[<folder>/]<module>.py: seconds} from the testcases' classname
    (tests.[<folder>.]<module>[.<Class>], the module being the first part named test_*)."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next((k for k, part in enumerate(parts) if part.startswith("test_")), None)
        if len(parts) < 2 or parts[0] != "tests" or module is None:
            raise SystemExit(
                f"{report}: testcase classname {case.get('classname')!r} is not tests.[<folder>.]<module>: run pytest "
                f"from the repository root"
            )
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    return {f: round(s, 1) for f, s in seconds.most_common()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="a JUnit XML report of a whole-suite run (pytest --junitxml)")
    args = ap.parse_args()
    if not args.report.is_file():
        print(
            f"{args.report}: no such report; write one with 'python -m pytest --junitxml={args.report}'",
            file=sys.stderr,
        )
        return 2
    record = file_seconds(args.report)
    RECORD.write_text(json.dumps(record, indent=0) + "\n")
    print(f"wrote {RECORD.relative_to(REPO)}: {len(record)} files, {sum(record.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
