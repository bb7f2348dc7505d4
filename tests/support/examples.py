"""The example task set (examples/tasks) and a reference solution per task, written into a
sandbox by a command harness."""

from __future__ import annotations

import shlex
import textwrap

from sandbox.presets import Harness
from sandbox.tasks import load_tasks
from tests.support.gateway import REPO

TASKS = {t.id: t for t in load_tasks(REPO / "examples" / "tasks" / "tasks.jsonl")}

SOLUTIONS = {
    "fizzbuzz": ("fizzbuzz.py", '''
        def fizzbuzz(n):
            return [("Fizz" * (i % 3 == 0) + "Buzz" * (i % 5 == 0)) or str(i)
                    for i in range(1, n + 1)]
    '''),
    "is_palindrome": ("palindrome.py", '''
        def is_palindrome(text):
            kept = [c.lower() for c in text if c.isalnum()]
            return kept == kept[::-1]
    '''),
    "merge_intervals": ("intervals.py", '''
        def merge_intervals(intervals):
            merged = []
            for start, end in sorted(intervals):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            return merged
    '''),
    "roman_to_int": ("roman.py", '''
        VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}

        def roman_to_int(numeral):
            total = 0
            for a, b in zip(numeral, numeral[1:] + " "):
                value = VALUES[a]
                total += -value if b != " " and VALUES[b] > value else value
            return total
    '''),
    "word_count": ("words.py", '''
        import re
        from collections import Counter

        def word_count(text):
            words = re.findall(r"[a-z0-9]+(?:'[a-z0-9]+)*", text.lower())
            return dict(Counter(words))
    '''),
}


def writer(path: str, code: str) -> Harness:
    script = f"open({path!r}, 'w').write({textwrap.dedent(code)!r})"
    return Harness(preset="command", model="m", command=f"python -c {shlex.quote(script)}")
