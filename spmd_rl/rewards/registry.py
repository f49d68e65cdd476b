"""Rule rewards: ``fn(response, answer, row) -> score``, or ``-> {"score": s, <name>: value, ...}``
(the other entries are logged as ``reward/<name>`` means). ``row`` is what the dataset row
carries besides the answer: ``prompt`` (its chat messages), ``data_source`` and ``extra_info``
(``data.PromptSet.info``).

- ``exact_match``: 1.0 if the response's answer (``reward.extract``: the whole response, GSM8K's
  ``#### n``, the last ``\\boxed{}``, or the last number; thousands commas dropped) equals the
  numeric answer (or, for a non-numeric answer, the same text), else 0.0.
- ``math_verify``: 1.0 if ``math-verify`` judges the response's final LaTeX answer equal to the
  reference (install ``math-verify``).
- ``module:function``: any importable function with the same signature. One of two arguments
  ``(response, answer)``, 0.1's signature, is read until 0.3 with a warning.

``reward.format_score`` f: a registered rule scores r = 1 if correct, f if the response is
well formed (``exact_match``: an answer is found and parses as a number; ``math_verify``: an
answer can be parsed from it) but wrong, else 0. A user function's score is used as it is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

from spmd_rl.catalog import Registry, user_function
from spmd_rl.rewards.extract import EXTRACTORS

log = logging.getLogger("spmd_rl")

RewardFn = Callable[[str, str, dict], "float | dict[str, float]"]


def _number(text: str | None) -> Fraction | None:
    if text is None:
        return None
    try:
        return Fraction(text.strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(response: str, answer: str, row: dict | None = None, extract: str = "strict") -> float:
    got_text = EXTRACTORS[extract](response)
    got, want = _number(got_text), _number(answer)
    if want is None:
        return float(got_text is not None and got_text.strip() == answer.strip())
    return float(got is not None and got == want)


def is_number(response: str, extract: str = "strict") -> bool:
    return _number(EXTRACTORS[extract](response)) is not None


def _math_verify_api():
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - depends on the optional package
        raise RuntimeError("reward.rule=math_verify needs the math-verify package: pip install math-verify") from exc
    return parse, verify


def math_verify(response: str, answer: str, row: dict | None = None) -> float:
    """math-verify's own timeouts use ``signal.alarm``, which only the main thread may set: they
    are off here, and the reward pool's deadline (``reward.timeout_s``) bounds each call."""
    parse, verify = _math_verify_api()
    return float(
        verify(parse(answer, parsing_timeout=None), parse(response, parsing_timeout=None), timeout_seconds=None)
    )


def parses_as_math(response: str) -> bool:
    parse, _ = _math_verify_api()
    return len(parse(response, parsing_timeout=None)) > 0


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``correct(response, answer, row)`` in [0, 1], and ``formed(response)``,
    whether the response is a well-formed answer (``reward.format_score``); ``extracts``: it
    reads ``reward.extract``."""

    correct: Callable[..., float]
    formed: Callable[..., bool]
    extracts: bool = False


RULES: Registry[Rule] = Registry("reward rule", "; or a user's module:function (response, answer, row) -> score")
"""``reward.rule`` -> its ``Rule``; the config check reads the names from here."""
RULES.register("exact_match")(Rule(exact_match, is_number, extracts=True))
RULES.register("math_verify")(Rule(math_verify, parses_as_math))


def get_reward(rule: str, format_score: float = 0.0, extract: str = "strict") -> RewardFn:
    """The reward ``reward.rule`` names, as ``fn(response, answer, row)``: a registered rule
    (scored 1 if correct, else ``format_score`` if well formed, else 0; ``extract``: where
    ``exact_match`` finds the answer), or a user's ``module:function`` as it is."""
    if ":" in rule:
        return _three_arguments(user_function(rule, f"reward.rule={rule!r}"), rule)
    found = RULES.lookup(rule)
    correct = partial(found.correct, extract=extract) if found.extracts else found.correct
    formed = partial(found.formed, extract=extract) if found.extracts else found.formed
    if format_score == 0:
        return lambda response, answer, row=None: correct(response, answer, row)

    def scored(response: str, answer: str, row: dict | None = None) -> float:
        if correct(response, answer, row) > 0.5:
            return 1.0
        return format_score if formed(response) else 0.0

    return scored


def _three_arguments(fn: Callable, rule: str) -> RewardFn:
    """``fn`` called as ``fn(response, answer, row)``; one taking only (response, answer) is
    wrapped, with a warning, until 0.3."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return fn
    log.warning(
        "reward.rule=%s takes (response, answer): 0.2 also hands it the row (data_source, extra_info, prompt) as a "
        "third argument; the two-argument form is read until 0.3: add the row argument",
        rule,
    )
    return lambda response, answer, row=None: fn(response, answer)


def score_of(value: Any, rule: str) -> tuple[float, dict[str, float]]:
    """A reward's return value as (score, extra metrics): a number, or a dict with a numeric
    ``score`` and numeric metrics; anything else is a ``TypeError`` naming the rule."""
    if isinstance(value, dict):
        extra = {k: v for k, v in value.items() if k != "score"}
        if _numeric(value.get("score")) and all(isinstance(k, str) and _numeric(v) for k, v in extra.items()):
            return float(value["score"]), {k: float(v) for k, v in extra.items()}
    elif _numeric(value):
        return float(value), {}
    raise TypeError(
        f"reward.rule={rule} returned {value!r:.80}: return a number, or a dict with a numeric 'score' and numeric "
        "metrics"
    )


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) or type(v).__name__ in ("float32", "float64")
