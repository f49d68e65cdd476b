"""``spmd_rl.catalog``: a declared entry is imported at its first lookup, not before; names
register once; an unknown name lists the registered ones; a name with a colon is a user's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd_rl.catalog import Registry
from tests.conftest import REPO


def test_a_declared_entry_is_imported_at_its_first_lookup_and_its_meta_before():
    code = (
        "import sys; from spmd_rl.catalog import Registry; r = Registry('thing'); "
        "r.declare('ast', 'ast:parse', meta={'fast': True}); "
        "print('ast' in sys.modules, r.meta['ast'], 'ast' in r); "
        "f = r.lookup('ast'); print('ast' in sys.modules, f is sys.modules['ast'].parse, r['ast'] is f)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False {'fast': True} True", "True True True"], out


def test_names_register_once_and_unknown_ones_are_listed():
    r: Registry = Registry("widget", "; or a user's module:function")
    r.declare("a", "json:dumps")
    r.register("b")(len)
    with pytest.raises(ValueError, match="widget 'a' registered twice"):
        r.register("a")(len)
    with pytest.raises(ValueError, match="widget 'b' registered twice"):
        r.declare("b", "json:loads")
    with pytest.raises(ValueError, match=r"unknown widget 'c'; registered: a, b; or a user's module:function"):
        r.lookup("c")
    assert r.lookup("json:loads").__name__ == "loads"  # a user's, not registered
    r.declare("gone", "json:no_such")
    with pytest.raises(ValueError, match="widget 'gone': json has no attribute 'no_such'"):
        r.lookup("gone")
