"""Rule rewards: ``fn(response_text, answer) -> float``.

- ``exact_match``: 1.0 if the response (stripped, up to the first whitespace-separated token
  that parses as a number) equals the numeric answer, else 0.0.
- ``math_verify``: 1.0 if ``math-verify`` judges the response's final LaTeX answer equal to the
  reference (install ``math-verify``).
- ``module:function``: any importable function with the same signature.

``reward.format_score`` f: a registered rule scores r = 1 if correct, f if the response is
well formed (``exact_match``: it parses as a number; ``math_verify``: an answer can be parsed
from it) but wrong, else 0. A user function's score is used as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from spmd_rl.algos.registry import user_function

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


REGISTRY: dict[str, tuple[RewardFn, Callable[[str], bool]]] = {
    "exact_match": (exact_match, is_number),
    "math_verify": (math_verify, parses_as_math),
}


def get_reward(rule: str, format_score: float = 0.0) -> RewardFn:
    if rule in REGISTRY:
        correct, formed = REGISTRY[rule]
        if format_score == 0:
            return correct

        def scored(response: str, answer: str) -> float:
            if correct(response, answer) > 0.5:
                return 1.0
            return format_score if formed(response) else 0.0

        return scored
    return user_function(rule, f"reward.rule={rule!r}")
