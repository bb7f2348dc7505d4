"""The templates of the learning experiment's task family (pure): single-function Python tasks
with random names, constants and examples.

A template draws one instance from a `random.Random`: the function's name and signature, one
sentence saying what it returns, the reference body (a Python expression over the parameters,
used only here to compute the expected outputs) and argument tuples for examples and tests.
`IN_DISTRIBUTION` templates are trained and evaluated; `OUT_OF_DISTRIBUTION` ones are never
trained, only evaluated, as a probe of transfer.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_VERBS = ("compute", "get", "make", "find", "calc", "process", "transform", "build", "apply",
          "derive", "produce", "eval")
_NOUNS = ("value", "result", "total", "score", "item", "data", "output", "number", "answer",
          "entry", "record", "amount", "token", "series", "signal", "payload")
_WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon",
          "candle", "garden", "rocket", "silver", "window", "yellow", "basket")


@dataclass(frozen=True)
class Instance:
    """One drawn task: `reference` is an expression over `params`' names."""

    template: str
    func: str
    params: tuple[tuple[str, str], ...]  # (name, type annotation)
    returns: str
    doc: str
    reference: str
    cases: tuple[tuple[Any, ...], ...]  # argument tuples: the first two are the prompt's examples

    @property
    def signature(self) -> str:
        return ", ".join(f"{n}: {t}" for n, t in self.params)

    def evaluate(self, args: tuple[Any, ...]) -> Any:
        """The reference output for `args` (our own expression, never a model's code)."""
        fn = eval(f"lambda {', '.join(n for n, _ in self.params)}: {self.reference}")  # noqa: S307
        return fn(*args)


Draw = Callable[[random.Random], tuple[tuple[tuple[str, str], ...], str, str, str, list]]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 40) -> list[tuple[int]]:
    return [(rng.randint(lo, hi),) for _ in range(n)]


def _lists(rng: random.Random, n: int, lo: int = -10, hi: int = 30) -> list[tuple[list[int]]]:
    return [([rng.randint(lo, hi) for _ in range(rng.randint(3, 7))],) for _ in range(n)]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _letter(rng: random.Random, within: str | None = None) -> str:
    return rng.choice(within or string.ascii_lowercase)


def _strings(rng: random.Random, n: int) -> list[tuple[str]]:
    return [(_word(rng) + rng.choice(("", _word(rng))),) for _ in range(n)]


X_INT = (("x", "int"),)
XS = (("xs", "list[int]"),)
S_STR = (("s", "str"),)


# Each draw returns (params, returns, doc, reference, cases).

def affine(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    return X_INT, "int", f"Return x multiplied by {a}, plus {b}.", f"{a} * x + {b}", _ints(rng, 6)


def clamp(rng: random.Random):
    lo = rng.randint(-10, 5)
    hi = lo + rng.randint(5, 25)
    return (X_INT, "int", f"Return x limited to the range {lo} to {hi}: {lo} if x is below "
            f"{lo}, {hi} if x is above {hi}, otherwise x.", f"min(max(x, {lo}), {hi})",
            _ints(rng, 6, lo - 15, hi + 15))


def distance(rng: random.Random):
    k = rng.randint(-10, 30)
    return X_INT, "int", f"Return the absolute difference between x and {k}.", f"abs(x - {k})", \
        _ints(rng, 6)


def divisible(rng: random.Random):
    k = rng.randint(2, 9)
    cases = [(k * rng.randint(-5, 9),) for _ in range(3)] + _ints(rng, 3)
    rng.shuffle(cases)
    return X_INT, "bool", f"Return True if x is divisible by {k}, otherwise False.", \
        f"x % {k} == 0", cases


def keep_greater(rng: random.Random):
    t = rng.randint(0, 15)
    return XS, "list[int]", f"Return a list of the numbers in xs that are greater than {t}, " \
        "in their original order.", f"[v for v in xs if v > {t}]", _lists(rng, 6)


def add_each(rng: random.Random):
    k = rng.randint(2, 15)
    return XS, "list[int]", f"Return a new list with {k} added to every number in xs.", \
        f"[v + {k} for v in xs]", _lists(rng, 6)


def count_below(rng: random.Random):
    t = rng.randint(0, 20)
    return XS, "int", f"Return how many numbers in xs are less than {t}.", \
        f"sum(1 for v in xs if v < {t})", _lists(rng, 6)


def sum_multiples(rng: random.Random):
    k = rng.randint(2, 5)
    return XS, "int", f"Return the sum of the numbers in xs that are divisible by {k}.", \
        f"sum(v for v in xs if v % {k} == 0)", _lists(rng, 6)


def max_plus(rng: random.Random):
    k = rng.randint(1, 20)
    return XS, "int", f"Return the largest number in xs plus {k}. xs is never empty.", \
        f"max(xs) + {k}", _lists(rng, 6)


def count_letter(rng: random.Random):
    c = _letter(rng, "aeilnort")
    return S_STR, "int", f"Return how many times the letter '{c}' occurs in s.", \
        f"s.count({c!r})", _strings(rng, 6)


def wrap(rng: random.Random):
    p, q = rng.choice("<[({#*"), rng.choice(">])}#*")
    return S_STR, "str", f"Return s with '{p}' added before it and '{q}' added after it.", \
        f"{p!r} + s + {q!r}", _strings(rng, 6)


def swap_letter(rng: random.Random):
    c1 = _letter(rng, "aeionr")
    c2 = _letter(rng, "xyzqk")
    return S_STR, "str", f"Return s with every '{c1}' replaced by '{c2}'.", \
        f"s.replace({c1!r}, {c2!r})", _strings(rng, 6)


def repeat_join(rng: random.Random):
    n, sep = rng.randint(2, 4), rng.choice("-+,;:")
    return S_STR, "str", f"Return s repeated {n} times, the copies joined by '{sep}'.", \
        f"{sep!r}.join([s] * {n})", _strings(rng, 6)


# ---- out of distribution: never trained ----

def reverse_words(rng: random.Random):
    sep = rng.choice("-+,;:")
    cases = [(" ".join(_word(rng) for _ in range(rng.randint(2, 4))),) for _ in range(6)]
    return S_STR, "str", f"Return the words of s (separated by spaces) in reverse order, " \
        f"joined by '{sep}'.", f"{sep!r}.join(reversed(s.split()))", cases


def digit_sum_times(rng: random.Random):
    k = rng.randint(2, 9)
    return (("n", "int"),), "int", f"Return the sum of the decimal digits of n (n >= 0), " \
        f"multiplied by {k}.", f"sum(int(d) for d in str(n)) * {k}", \
        [(rng.randint(0, 9999),) for _ in range(6)]


def last_even(rng: random.Random):
    d = rng.randint(-9, -1)
    return XS, "int", f"Return the last even number in xs, or {d} if xs has none.", \
        f"next((v for v in reversed(xs) if v % 2 == 0), {d})", _lists(rng, 6)


IN_DISTRIBUTION: dict[str, Draw] = {f.__name__: f for f in (
    affine, clamp, distance, divisible, keep_greater, add_each, count_below, sum_multiples,
    max_plus, count_letter, wrap, swap_letter, repeat_join)}
OUT_OF_DISTRIBUTION: dict[str, Draw] = {f.__name__: f for f in (
    reverse_words, digit_sum_times, last_even)}
ALL: dict[str, Draw] = {**IN_DISTRIBUTION, **OUT_OF_DISTRIBUTION}


def draw(template: str, rng: random.Random) -> Instance:
    """One instance of `template` from `rng` (deterministic for a given state)."""
    params, returns, doc, reference, cases = ALL[template](rng)
    return Instance(template, _name(rng), params, returns, doc, reference,
                    tuple(tuple(c) for c in cases))
