"""Where a response's final answer is (``reward.extract``), for ``exact_match``:

- ``strict``: the whole response, stripped (a model trained to answer with the number alone);
- ``gsm8k``: the number after the last ``####`` (GSM8K's answer format, verl's strict mode);
- ``boxed``: the content of the last ``\\boxed{...}``, braces balanced (MATH's format);
- ``last_number``: the last number in the response (verl's GSM8K flexible mode).

Each returns the answer's text, or None when the response holds none (not well formed).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_GSM8K = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_ANY_NUMBER = re.compile(_NUMBER)


def strict(response: str) -> str | None:
    return response.strip() or None


def gsm8k(response: str) -> str | None:
    found = _GSM8K.findall(response)
    return found[-1] if found else None


def last_number(response: str) -> str | None:
    found = _ANY_NUMBER.findall(response)
    return found[-1] if found else None


def boxed(response: str) -> str | None:
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(response)):
        depth += {"{": 1, "}": -1}.get(response[j], 0)
        if depth == 0:
            return response[i:j].strip()
    return None  # unbalanced: cut off before its closing brace


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "strict": strict,
    "gsm8k": gsm8k,
    "boxed": boxed,
    "last_number": last_number,
}
"""``reward.extract`` -> its extractor."""
