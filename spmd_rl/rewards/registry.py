"""Rule rewards: ``fn(response_text, answer) -> float``.

- ``exact_match``: 1.0 if the whole response (stripped, thousands commas dropped) is a number
  equal to the numeric answer (or, for a non-numeric answer, the same text), else 0.0.
- ``math_verify``: 1.0 if ``math-verify`` judges the response's final LaTeX answer equal to the
  reference (install ``math-verify``).
- ``module:function``: any importable function with the same signature.

``reward.format_score`` f: a registered rule scores r = 1 if correct, f if the response is
well formed (``exact_match``: it parses as a number; ``math_verify``: an answer can be parsed
from it) but wrong, else 0. A user function's score is used as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from spmd_rl.catalog import Registry, user_function

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


def is_number(response: str) -> bool:
    return _number(response) is not None


def _math_verify_api():
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("reward.rule=math_verify needs the math-verify package: pip install math-verify") from exc
    return parse, verify


def math_verify(response: str, answer: str) -> float:
    parse, verify = _math_verify_api()
    return float(verify(parse(answer), parse(response)))


def parses_as_math(response: str) -> bool:
    parse, _ = _math_verify_api()
    return len(parse(response)) > 0


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``correct(response, answer)`` in [0, 1], and ``formed(response)``,
    whether the response is a well-formed answer (``reward.format_score``)."""

    correct: RewardFn
    formed: Callable[[str], bool]


RULES: Registry[Rule] = Registry("reward rule", "; or a user's module:function (response, answer) -> float")
"""``reward.rule`` -> its ``Rule``; the config check reads the names from here."""
RULES.register("exact_match")(Rule(exact_match, is_number))
RULES.register("math_verify")(Rule(math_verify, parses_as_math))


def get_reward(rule: str, format_score: float = 0.0) -> RewardFn:
    """The reward ``reward.rule`` names: a registered rule (scored 1 if correct, else
    ``format_score`` if well formed, else 0), or a user's ``module:function`` as it is."""
    if ":" in rule:
        return user_function(rule, f"reward.rule={rule!r}")
    found = RULES.lookup(rule)
    if format_score == 0:
        return found.correct

    def scored(response: str, answer: str) -> float:
        if found.correct(response, answer) > 0.5:
            return 1.0
        return format_score if found.formed(response) else 0.0

    return scored
