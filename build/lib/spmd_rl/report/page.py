"""The report's single self-contained HTML page: every figure inlined as a base64 PNG, the figures
without data listed, and the run's validated config (``config.json``, written by rank 0 at
start) as a table."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from spmd_rl.report.plots import Figure


def _flat(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, json.dumps(v)))
    return out


def render(title: str, drawn: list[tuple[Figure, Path]], empty: list[Figure], config: dict | None, rows: int) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1500px}img{width:680px;margin:4px;border:1px solid "
        "#ddd}"
        "table{border-collapse:collapse;font-size:13px}td{border:1px solid #ddd;padding:2px "
        "8px;font-family:monospace}</style>",
        f"</head><body><h1>{html.escape(title)}</h1><p>{rows} iterations logged.</p>",
    ]
    for fig, path in drawn:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(
            f"<img alt='{html.escape(fig.title)}' title='{html.escape(fig.title)}' src='data:image/png;base64,{data}'>"
        )
    if empty:
        parts.append(
            "<p>No data for: " + ", ".join(f"{html.escape(f.title)} ({', '.join(f.metrics)})" for f in empty) + ".</p>"
        )
    parts.append("<h2>Config</h2>")
    if config is None:
        parts.append("<p>No config.json in the run's logging folder.</p>")
    else:
        parts.append(
            "<table>"
            + "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _flat(config))
            + "</table>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)
