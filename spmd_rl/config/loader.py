"""YAML file + dotted ``key=value`` overrides -> a typed :class:`Config`.

Override values are parsed as YAML scalars/flow collections, so ``actor.optim.lr=1e-5`` is a float,
``metadata.endpoints=[a:2379,b:2379]`` a list and ``checkpoint.interval=null`` is None.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from spmd_rl.config.errors import ConfigError, Violation
from spmd_rl.config.renamed import rename_path, rename_tree
from spmd_rl.config.schema import NOT_IMPLEMENTED, Config

_MISSING = "<missing>"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` (no dot) as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], parsed value)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            [
                Violation(
                    text, text, "override is not of the form section.field=value", "write it like actor.optim.lr=1e-5"
                )
            ],
            source="overrides",
        )
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([Violation(key, raw, f"value is not valid YAML ({exc.problem})", "quote it")], "overrides")
    return key.split("."), value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key in a copy of ``tree``, creating sections on the way (unknown keys
    are then reported by the schema, not silently accepted)."""
    out = yaml.safe_load(yaml.safe_dump(tree)) or {}
    for text in overrides:
        path, value = parse_override(text)
        path = rename_path(path)
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [
                Violation(
                    "CONFIG", str(p), "file not found", "pass the path of a YAML config, e.g. configs/quickstart.yaml"
                )
            ],
            str(p),
        )
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [Violation("CONFIG", str(p), f"not UTF-8 text (byte {exc.start})", "pass a YAML text file saved as UTF-8")],
            str(p),
        ) from None
    except OSError as exc:
        raise ConfigError(
            [Violation("CONFIG", str(p), f"cannot be read ({exc.strerror})", "check the path and its permissions")],
            str(p),
        ) from None
    try:
        tree = _yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(
            [
                Violation(
                    "CONFIG", str(p), f"invalid YAML at {where}: {getattr(exc, 'problem', exc)}", "fix the YAML syntax"
                )
            ],
            str(p),
        )
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            [
                Violation(
                    "CONFIG",
                    str(p),
                    "top level is not a mapping of sections",
                    "start the file with `model:`, `data:`, ...",
                )
            ],
            str(p),
        )
    return tree


def _lookup(tree: Any, loc: tuple) -> Any:
    node = tree
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return _MISSING
    return node


def _field_info(loc: tuple):
    """Description and model class of the field at ``loc`` (for the fix text)."""
    model: type[BaseModel] | None = Config
    info = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return info, model
        info = model.model_fields[part]
        ann = info.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return info, model


def _violation(err: dict, tree: dict) -> Violation:
    loc = tuple(err["loc"])
    field = ".".join(str(p) for p in loc)
    value = _lookup(tree, loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        if field in NOT_IMPLEMENTED:
            return Violation(field, value, NOT_IMPLEMENTED[field], "remove the field")
        _, parent = _field_info(loc[:-1])
        known = ", ".join(parent.model_fields) if parent else ""
        return Violation(field, value, "unknown field", f"remove it or fix the spelling; known fields here: {known}")
    info, _ = _field_info(loc)
    desc = info.description if info is not None and info.description else ""
    if kind == "missing":
        return Violation(field, _MISSING, "required field is missing", f"add it: {desc}".rstrip(": "))
    fix = f"{err['msg'][0].lower()}{err['msg'][1:]}"
    return Violation(field, value, "invalid value", f"{fix}" + (f" ({desc})" if desc else ""))


def build_config(tree: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError([_violation(e, tree) for e in exc.errors()], source) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and type-check a config (cross-field rules are in ``rules.check``)."""
    tree = apply_overrides(rename_tree(read_yaml(path), str(path)), overrides or [])
    return build_config(tree, str(path))
