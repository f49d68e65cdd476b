"""The configuration reference (``docs/config.md``), rendered from the schema itself: every
field of every section with its type, default, valid range and description. ``spmd-rl
config-reference`` prints it; a test fails when the file in ``docs/`` differs from what the
schema renders, so the reference cannot drift from the code."""

from __future__ import annotations

import json
import typing

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from spmd_rl.config.renamed import RENAMED, UNTIL
from spmd_rl.config.schema import Config

HEADER = """# Configuration reference

Generated from `spmd_rl/config/schema.py` by `spmd-rl config-reference > docs/config.md`;
`tests/unit/test_config_reference.py` fails when this file is out of date. A config is a YAML file
of these sections; any field can be overridden on the command line as `section.field=value`.
Unknown fields are errors; `spmd-rl validate` also checks the rules that relate fields to each
other, to the world size and to files on disk (`spmd_rl/recipe/rules.py`).
"""


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return "tuple of " + ", ".join(_type(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Annotated:  # a range on a tuple's element
        base, *meta = typing.get_args(annotation)
        ranges = [_range(m) for m in meta if isinstance(m, FieldInfo)]
        return _type(base) + "".join(f" ({r})" for r in ranges if r)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):  # a nested section: its fields
        return "{" + ", ".join(f"{k}: {_type(f.annotation)}" for k, f in annotation.model_fields.items()) + "}"
    args = typing.get_args(annotation)
    if args and any(isinstance(a, type) and issubclass(a, BaseModel) for a in args):  # an optional section
        return " or ".join("None" if a is type(None) else _type(a) for a in args)
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "or")


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        return "(section)" if isinstance(value, BaseModel) else json.dumps(value)
    return json.dumps(info.default)


def _range(info: FieldInfo) -> str:
    bounds = {Gt: (">", "gt"), Ge: (">=", "ge"), Lt: ("<", "lt"), Le: ("<=", "le")}
    return ", ".join(
        f"{bounds[type(m)][0]} {getattr(m, bounds[type(m)][1])}" for m in info.metadata if type(m) in bounds
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        nested = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if nested is not None:
            rows += _rows(nested, f"{prefix}{name}.")
            continue
        rows.append(
            f"| `{prefix}{name}` | {_cell(_type(annotation))} | `{_cell(_default(info))}` | {_range(info)} | "
            f"{_cell(info.description or '')} |"
        )
        optional = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if optional:  # a section that may be null: its own fields below it
            rows += _rows(optional[0], f"{prefix}{name}.")
    return rows


def render() -> str:
    out = [HEADER]
    for section, info in Config.model_fields.items():
        model = typing.get_args(info.annotation)[0] if typing.get_args(info.annotation) else info.annotation
        out.append(f"\n## `{section}`{' (required)' if info.is_required() else ''}\n")
        out.append("| field | type | default | range | description |\n|---|---|---|---|---|")
        out += _rows(model, f"{section}.")
    out.append(
        f"\n## Renamed fields\n\nRead under their old names, with a warning naming the new one, until {UNTIL}.\n"
    )
    out.append("| old | new |\n|---|---|")
    out += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    return "\n".join(out) + "\n"
