"""The real-model demo's parts that need no model: the code-block agent's parsing, the held-out
pass@1 arithmetic, and the task set itself (every task's hidden tests pass on a correct solution
and fail on the starting file)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.agents.code_writer import extract_code, target_file, user_message
from sandbox.tasks import load_tasks
from stack.real_demo import SMOL_TASKS, bootstrap, interval, pass_at_1, passed

# A correct solution per task, to check that the hidden tests can be passed at all.
REFERENCE = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_even": "def is_even(n):\n    return n % 2 == 0\n",
    "square": "def square(x):\n    return x * x\n",
    "reverse_string": "def reverse_string(s):\n    return s[::-1]\n",
    "max_of_list": "def max_of_list(numbers):\n    return max(numbers)\n",
    "sum_list": "def sum_list(numbers):\n    return sum(numbers)\n",
    "factorial": "import math\n\ndef factorial(n):\n    return math.factorial(n)\n",
    "count_vowels": "def count_vowels(text):\n    return sum(c in 'aeiouAEIOU' for c in text)\n",
    "celsius_to_fahrenheit": "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                 "        a, b = b, a + b\n    return a\n",
    "fizzbuzz": "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
                "else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n",
    "is_palindrome": "def is_palindrome(text):\n    t = text.lower()\n    return t == t[::-1]\n",
    "count_words": "def count_words(text):\n    return len(text.split())\n",
    "remove_duplicates": "def remove_duplicates(items):\n    return list(dict.fromkeys(items))\n",
    "gcd": "import math\n\ndef gcd(a, b):\n    return math.gcd(a, b)\n",
    "digit_sum": "def digit_sum(n):\n    return sum(map(int, str(n)))\n",
    "second_largest": "def second_largest(numbers):\n    return sorted(set(numbers))[-2]\n",
    "running_sum": "import itertools\n\ndef running_sum(numbers):\n"
                   "    return list(itertools.accumulate(numbers))\n",
    "char_frequency": "from collections import Counter\n\ndef char_frequency(text):\n"
                      "    return dict(Counter(text))\n",
    "capitalize_words": "def capitalize_words(text):\n"
                        "    return ' '.join(w[:1].upper() + w[1:] for w in text.split(' '))\n",
    "flatten": "def flatten(lists):\n    return [x for sub in lists for x in sub]\n",
    "merge_sorted": "def merge_sorted(a, b):\n    return sorted(a + b)\n",
    "is_anagram": "def is_anagram(a, b):\n    return sorted(a.lower()) == sorted(b.lower())\n",
    "balanced_brackets": (
        "def balanced_brackets(text):\n    stack = []\n    for c in text:\n"
        "        if c in '([{':\n            stack.append(c)\n        elif c in ')]}':\n"
        "            if not stack or '([{'[')]}'.index(c)] != stack.pop():\n"
        "                return False\n    return not stack\n"),
    "run_length_encode": "import itertools\n\ndef run_length_encode(text):\n    return ''.join("
                         "k + str(len(list(g))) for k, g in itertools.groupby(text))\n",
    "roman_to_int": (
        "def roman_to_int(s):\n    v = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)\n"
        "    return sum(-v[c] if i + 1 < len(s) and v[s[i + 1]] > v[c] else v[c]\n"
        "               for i, c in enumerate(s))\n"),
    "caesar_shift": "def caesar_shift(text, k):\n"
                    "    return ''.join(chr((ord(c) - 97 + k) % 26 + 97)"
                    " if 'a' <= c <= 'z' else c for c in text)\n",
    "binary_search": "import bisect\n\ndef binary_search(items, target):\n"
                     "    i = bisect.bisect_left(items, target)\n"
                     "    return i if i < len(items) and items[i] == target else -1\n",
    "transpose": "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]\n",
}


# ---- the agent ------------------------------------------------------------------------------


def test_the_last_fenced_block_is_the_code():
    reply = "Here:\n```python\nx = 1\n```\nExample:\n```python\ndef f():\n    return 2\n```\nDone."
    assert extract_code(reply) == "def f():\n    return 2\n"


def test_an_unclosed_block_cut_at_the_token_limit_still_counts():
    assert extract_code("```py\ndef f():\n    return 1") == "def f():\n    return 1\n"


def test_no_block_means_no_code():
    assert extract_code("def f(): return 1") is None
    assert extract_code("```python\n\n```") is None


@given(st.text(alphabet=st.characters(blacklist_characters="`"), min_size=1).filter(str.strip))
def test_any_code_without_fences_survives_a_round_trip(code):
    body = code.rstrip()
    assert extract_code(f"Sure.\n```python\n{body}\n```\nThat is all.") == body + "\n"


def test_the_agent_completes_the_one_python_file(tmp_path):
    (tmp_path / "add.py").write_text("def add(a, b):\n    raise NotImplementedError\n")
    (tmp_path / "README.md").write_text("notes")
    path = target_file(tmp_path)
    assert path.name == "add.py"
    assert "add.py:\n```python\ndef add(a, b):" in user_message("Implement add.", path)
    (tmp_path / "other.py").write_text("")
    with pytest.raises(ValueError, match="exactly one .py file"):
        target_file(tmp_path)


# ---- pass@1 ---------------------------------------------------------------------------------


def test_pass_at_1_is_the_mean_of_per_task_rates():
    assert passed(1.0) and not passed(0.99) and not passed(None)
    assert pass_at_1({"a": [True, False], "b": [False, False, False, True]}) == pytest.approx(
        (0.5 + 0.25) / 2)


def test_the_bootstrap_interval_holds_the_estimate_and_shrinks_with_more_rollouts():
    few = {"a": [True, False] * 2, "b": [False] * 3 + [True]}
    many = {k: v * 8 for k, v in few.items()}
    lo, hi = interval(bootstrap(few))
    assert lo <= pass_at_1(few) <= hi
    lo_many, hi_many = interval(bootstrap(many))
    assert hi_many - lo_many < hi - lo
    assert interval(bootstrap({"a": [True] * 5})) == (1.0, 1.0)


# ---- the task set ---------------------------------------------------------------------------


def _failing_tests(task, solution: str | None, root: Path) -> list[str]:
    """Run the task's hidden test functions against `solution` (None: the starting file), in
    this process: the hidden tests are plain functions with asserts."""
    work = root / task.id
    for name, data in {**task.files, **task.verifier.files}.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(data)
    (name,) = task.files
    if solution is not None:
        (work / name).write_text(solution)
    sys.path.insert(0, str(work))
    try:
        failing = []
        for test_file in sorted((work / "tests_hidden").glob("test_*.py")):
            sys.modules.pop(Path(name).stem, None)
            module = types.ModuleType(test_file.stem)
            exec(compile(test_file.read_text(), str(test_file), "exec"), module.__dict__)
            for fname, func in vars(module).items():
                if fname.startswith("test_"):
                    try:
                        func()
                    except Exception:
                        failing.append(fname)
        return failing
    finally:
        sys.path.remove(str(work))
        sys.modules.pop(Path(name).stem, None)


def test_the_split_has_training_and_held_out_tasks_with_base_rates():
    tasks = load_tasks(SMOL_TASKS)
    splits = {t.metadata["split"] for t in tasks}
    assert splits == {"train", "heldout", "pool"}
    assert set(REFERENCE) == {t.id for t in tasks}
    for split in ("train", "heldout"):
        rates = [t.metadata["base_mean_reward"] for t in tasks if t.metadata["split"] == split]
        assert min(rates) == 0 and max(rates) >= 0.5  # from rarely to often solved


def test_every_task_is_solvable_and_unsolved_at_the_start(tmp_path):
    failures = []
    for task in load_tasks(SMOL_TASKS):
        if failing := _failing_tests(task, REFERENCE[task.id], tmp_path / "solved"):
            failures.append(f"{task.id}: a correct solution fails {failing}")
        if not _failing_tests(task, None, tmp_path / "start"):
            failures.append(f"{task.id}: the starting file passes")
    assert not failures
