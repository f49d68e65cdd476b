"""Commit messages people can read with ``git log --oneline``: the subject is ``area: summary``
(one or more lower-case areas, comma-separated, then a summary) in at most 72 characters, then a
blank line before the body, where the evidence goes (numbers, what was broken on purpose).

``python tools/check_commits.py``: every commit after ``SINCE`` (the last commit before the rule;
in a shallow clone without it, every commit it has). ``python tools/check_commits.py --file F``:
one message (the ``commit-msg`` hook: ``git config core.hooksPath .githooks``). Exit 1 with each
offending subject and why."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

SINCE = "5e751da"
"""The newest commit whose subject predates the rule (their subjects run to 1,000 characters)."""
MAX_SUBJECT = 72
SUBJECT = re.compile(r"^[a-z0-9][a-z0-9_./-]*(, [a-z0-9][a-z0-9_./-]*)*: \S.*$")


def problems(message: str) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = message.rstrip("\n").split("\n")
    subject, found = lines[0], []
    if len(subject) > MAX_SUBJECT:
        found.append(f"subject has {len(subject)} characters, at most {MAX_SUBJECT}: move the detail to the body")
    if not SUBJECT.match(subject):
        found.append("subject is not 'area: summary' (a lower-case area such as 'elastic' or 'docs, test')")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def _commits() -> list[str]:
    has_since = subprocess.run(["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], capture_output=True).returncode == 0
    return _git("rev-list", "--no-merges", f"{SINCE}..HEAD" if has_since else "HEAD").split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="check this one message (a commit-msg hook's argument)")
    args = ap.parse_args()
    if args.file:
        with open(args.file) as f:
            text = "\n".join(line for line in f.read().split("\n") if not line.startswith("#"))
        messages = {"this commit": text}
    else:
        messages = {c[:10]: _git("log", "-1", "--format=%B", c) for c in _commits()}
    bad = {name: problems(text) for name, text in messages.items()}
    for name, found in bad.items():
        for why in found:
            print(f"{name}: {messages[name].split(chr(10))[0][:80]!r}: {why}", file=sys.stderr)
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
