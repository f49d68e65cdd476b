"""Rule rewards: ``fn(response_text, answer) -> float``.

- ``exact_match``: 1.0 if the response (stripped, up to the first whitespace-separated token
  that parses as a number) equals the numeric answer, else 0.0.
- ``math_verify``: 1.0 if ``math-verify`` judges the response's final LaTeX answer equal to the
  reference (install ``math-verify``).
- ``module:function``: any importable function with the same signature.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(response: str, answer: str) -> float:
    got, want = _number(response), _number(answer)
    if want is None:
        return float(response.strip() == answer.strip())
    return float(got is not None and got == want)


def math_verify(response: str, answer: str) -> float:
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("reward.rule=math_verify needs the math-verify package: pip install math-verify") from exc
    return float(verify(parse(answer), parse(response)))


REGISTRY: dict[str, RewardFn] = {"exact_match": exact_match, "math_verify": math_verify}


def get_reward(rule: str) -> RewardFn:
    if rule in REGISTRY:
        return REGISTRY[rule]
    module, _, name = rule.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"reward.rule={rule!r}: {module} has no function {name!r}")
    return fn
