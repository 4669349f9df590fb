"""Small Python edits: bug fixes, stubs, new keyword arguments, renames.

Every function comes from a pool of small specifications (source, docstring, inputs); the
expected results are computed at generation time by running the reference source, and
the tests import the module from /app and compare its behaviour on those inputs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS

Args = tuple


@dataclass(frozen=True)
class Spec:
    """A function: `source` defines it under the name NAME (replaced when used);
    `bugs` are (correct fragment, buggy fragment) pairs of that source; `inputs` draws
    argument tuples."""

    names: tuple[str, ...]
    source: str
    inputs: Callable[[random.Random], list[Args]]
    bugs: tuple[tuple[str, str], ...] = ()


def _ints(rng: random.Random, lo: int = -20, hi: int = 40, k: tuple[int, int] = (3, 9)
          ) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*k))]


def _text(rng: random.Random) -> str:
    words = [rng.choice(NOUNS + NAMES) for _ in range(rng.randint(1, 8))]
    return "".join(w + rng.choice((" ", " ", "  ", "\t", " \n ")) for w in words).strip()


SPECS: tuple[Spec, ...] = (
    Spec(("sum_between", "inclusive_sum", "range_total"), '''
def NAME(a, b):
    """Return the sum of all integers from a to b, both included (0 when a > b)."""
    total = 0
    for n in range(a, b + 1):
        total += n
    return total
''', lambda r: [(x, x + r.randint(0, 12)) for x in _ints(r, -10, 30, (4, 6))] + [(5, 2)],
        (("range(a, b + 1)", "range(a, b)"), ("range(a, b + 1)", "range(a + 1, b + 1)"))),
    Spec(("count_above", "how_many_above", "count_greater"), '''
def NAME(values, limit):
    """Return how many of the numbers in values are strictly greater than limit."""
    count = 0
    for v in values:
        if v > limit:
            count += 1
    return count
''', lambda r: [(v, r.choice(v)) for v in (_ints(r) for _ in range(5))] + [([], 3)],
        (("if v > limit:", "if v >= limit:"), ("if v > limit:", "if v < limit:"))),
    Spec(("last_items", "tail_of", "take_last"), '''
def NAME(items, n):
    """Return the last n items of the list items, in their order: all of them when
    n >= len(items), and [] when n <= 0."""
    if n <= 0:
        return []
    return items[-n:]
''', lambda r: [(_ints(r), r.randint(1, 4)) for _ in range(4)]
        + [([1, 2, 3], 0), (_ints(r), 0), ([4, 5], 7)],
        (("if n <= 0:", "if n < 0:"), ("return items[-n:]", "return items[-n + 1:]"))),
    Spec(("average", "mean_of", "arithmetic_mean"), '''
def NAME(values):
    """Return the arithmetic mean of values, a non-empty list of numbers."""
    return sum(values) / len(values)
''', lambda r: [(_ints(r, 0, 50, (2, 7)),) for _ in range(5)] + [([1, 2],), ([7, 8, 10],)],
        (("sum(values) / len(values)", "sum(values) // len(values)"),
         ("sum(values) / len(values)", "sum(values) / (len(values) - 1)"))),
    Spec(("clamp", "limit_to", "bounded"), '''
def NAME(x, low, high):
    """Return x limited to the range [low, high]: low when x < low, high when x > high,
    otherwise x itself."""
    if x < low:
        return low
    if x > high:
        return high
    return x
''', lambda r: [(r.randint(-30, 30), -5, r.randint(0, 10)) for _ in range(6)]
        + [(-9, 0, 5), (9, 0, 5), (3, 0, 5)],
        (("if x > high:\n        return high", "if x > high:\n        return low"),
         ("if x < low:", "if x > low:"))),
    Spec(("factorial", "fact", "product_up_to"), '''
def NAME(n):
    """Return n! (the product 1 * 2 * ... * n) for n >= 0; 0! is 1."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''', lambda r: [(n,) for n in r.sample(range(2, 13), 4)] + [(0,), (1,)],
        (("range(2, n + 1)", "range(2, n)"), ("range(2, n + 1)", "range(1, n)"))),
    Spec(("running_totals", "cumulative_sums", "prefix_sums"), '''
def NAME(values):
    """Return the running totals of values: item i is values[0] + ... + values[i]."""
    totals = []
    total = 0
    for v in values:
        total += v
        totals.append(total)
    return totals
''', lambda r: [(_ints(r, 1, 20),) for _ in range(4)] + [([],), ([5],)],
        (("total += v\n        totals.append(total)", "totals.append(total)\n        total += v"),
         ("total = 0\n", "total = 1\n"))),
    Spec(("count_words", "word_count", "number_of_words"), '''
def NAME(text):
    """Return the number of words in text, words being separated by any run of whitespace
    (spaces, tabs, newlines); an empty or blank text has 0 words."""
    return len(text.split())
''', lambda r: [(_text(r),) for _ in range(5)] + [("",), ("  two   words ",)],
        (("len(text.split())", "len(text.split(\" \"))"),
         ("len(text.split())", "text.count(\" \") + 1"))),
    Spec(("is_leap", "leap_year", "is_leap_year"), '''
def NAME(year):
    """Return True when year is a leap year of the Gregorian calendar: divisible by 4,
    except years divisible by 100 that are not divisible by 400."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''', lambda r: [(y,) for y in r.sample(range(1890, 2100), 5)] + [(1900,), (2000,), (2024,), (2023,)],
        (("(year % 100 != 0 or year % 400 == 0)", "(year % 100 != 0 and year % 400 == 0)"),
         ("year % 4 == 0 and", "year % 4 == 0 or"))),
    Spec(("index_of_max", "argmax", "position_of_largest"), '''
def NAME(values):
    """Return the index of the largest number in values (a non-empty list); when the
    largest value occurs more than once, the index of its first occurrence."""
    best = 0
    for i in range(1, len(values)):
        if values[i] > values[best]:
            best = i
    return best
''', lambda r: [(_ints(r, 0, 9, (4, 9)),) for _ in range(5)] + [([3, 9, 1, 9, 2],), ([1, 2, 8],)],
        (("if values[i] > values[best]:", "if values[i] >= values[best]:"),
         ("range(1, len(values))", "range(1, len(values) - 1)"))),
    Spec(("dedupe", "unique_in_order", "drop_repeats"), '''
def NAME(items):
    """Return the items of the list without duplicates, each kept at its first
    occurrence, in their original order."""
    seen = set()
    out = []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
''', lambda r: [(_ints(r, 0, 6, (4, 10)),) for _ in range(5)] + [([3, 1, 3, 2, 1],)],
        (("seen.add(x)\n            out.append(x)", "out.append(x)"),
         ("if x not in seen:", "if x in seen or not out:"))),
)


def _source(spec: Spec, name: str, text: str | None = None) -> str:
    return (text if text is not None else spec.source).replace("NAME", name).strip("\n") + "\n"


def _run(source: str, name: str, calls: list[Args], kwargs: dict | None = None) -> list:
    ns: dict = {}
    exec(compile(source, f"<{name}>", "exec"), ns)  # noqa: S102  (our own reference code)
    return [ns[name](*_copy(a), **(kwargs or {})) for a in calls]


def _same(got: object, want: object) -> bool:
    """As the tests compare: floats approximately, anything else by type and value."""
    if isinstance(want, float):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-6 * max(1, abs(want))
    return type(got) is type(want) and got == want


def _run_each(source: str, name: str, calls: list[Args]) -> list:
    """Like `_run`, an exception standing for the call's result."""
    ns: dict = {}
    exec(compile(source, f"<{name}>", "exec"), ns)  # noqa: S102
    out = []
    for a in calls:
        try:
            out.append(ns[name](*_copy(a)))
        except Exception as e:  # noqa: BLE001  (a buggy function may raise)
            out.append(e)
    return out


def _copy(args: Args) -> Args:
    return tuple(list(a) if isinstance(a, list) else a for a in args)


def _pick_names(rng: random.Random, specs: list[Spec]) -> list[str]:
    return [rng.choice(s.names) for s in specs]


MODULES = ("mathutils", "numtools", "listkit", "funcs_lib", "core_funcs", "textkit",
           "project_utils")

TEST_HEAD = '''import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest


def load(name="{module}"):
    sys.path.insert(0, "/app")
    try:
        spec = importlib.util.spec_from_file_location(name, f"/app/{{name}}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove("/app")


def same(got, want):
    if isinstance(want, float):
        return isinstance(got, (int, float)) and got == pytest.approx(want)
    return type(got) is type(want) and got == want
'''


def _cases_test(test: str, func: str, calls: list[Args], results: list,
                kwargs: dict | None = None, module: str | None = None) -> str:
    cases = list(zip(calls, results))
    kw = f", **{kwargs!r}" if kwargs else ""
    mod = f"{module!r}" if module else ""
    return f'''

@pytest.mark.parametrize("args,want", {cases!r})
def {test}(args, want):
    got = load({mod}).{func}(*args{kw})
    assert same(got, want), f"{func}{{args}} returned {{got!r}}, expected {{want!r}}"
'''


def _companions(rng: random.Random, exclude: Spec, k: int) -> list[Spec]:
    return rng.sample([s for s in SPECS if s is not exclude], k)


def _companion_tests(rng: random.Random, specs: list[Spec], names: list[str]) -> str:
    out = ""
    for spec, name in zip(specs, names):
        calls = spec.inputs(rng)
        out += _cases_test(f"test_{name}_still_works", name, calls,
                           _run(_source(spec, name), name, calls))
    return out


def _module_text(rng: random.Random, parts: list[str]) -> str:
    doc = rng.choice(("Small helpers used by the reporting scripts.",
                      "Utility functions shared by the project.",
                      "Assorted helper functions."))
    return f'"""{doc}"""\n\n\n' + "\n\n".join(parts)


def _replace_script(path: str, pairs: list[tuple[str, str]]) -> str:
    body = "".join(f"assert s.count({old!r}) == 1\ns = s.replace({old!r}, {new!r})\n"
                   for old, new in pairs)
    return (f"python3 - <<'PY'\nfrom pathlib import Path\np = Path({path!r})\n"
            f"s = p.read_text()\n{body}p.write_text(s)\nPY\n")


@family("fix-python-bug", skill="python", split="train")
def fix_python_bug(rng: random.Random) -> Instance:
    """A generated function with one injected bug (off-by-one, wrong operator, ...) to fix."""
    spec = rng.choice(SPECS)
    good_frag, bad_frag = rng.choice(spec.bugs)
    others = _companions(rng, spec, rng.randint(1, 2))
    name, *other_names = _pick_names(rng, [spec, *others])
    good = _source(spec, name)
    bad = _source(spec, name, spec.source.replace(good_frag, bad_frag, 1))
    assert bad != good
    while True:
        calls = spec.inputs(rng)
        want = _run(good, name, calls)
        got = _run_each(bad, name, calls)
        wrong = [i for i, (a, b) in enumerate(zip(want, got)) if not _same(b, a)
                 and not isinstance(b, Exception)]
        if len(wrong) >= 2:
            break
    module = rng.choice(MODULES)
    parts = [good if s is spec else _source(s, n) for s, n in zip([spec, *others],
                                                                    [name, *other_names])]
    rng.shuffle(parts)
    text = _module_text(rng, parts)
    buggy_text = text.replace(good, bad)
    assert buggy_text.count(bad_frag) == 1
    example = calls[wrong[0]]
    call = f"{name}({', '.join(map(repr, example))})"
    instruction = rng.choice((
        f"The function `{name}` in /app/{module}.py has a bug: it does not always do what "
        f"its docstring says. Fix it. Keep its name and signature, and leave the other "
        f"functions of the file working.",
        f"`{call}` (from /app/{module}.py) returns {got[wrong[0]]!r}, but according to its "
        f"docstring it should return {want[wrong[0]]!r}. Find and fix the bug in `{name}` "
        f"without changing its name or parameters.",
        f"Some callers of `{name}` in /app/{module}.py get wrong results. Make the function "
        f"behave exactly as its docstring describes; do not rename it or change its "
        f"parameters, and do not break anything else in the module.",
    ))
    tests = f'"""fix-python-bug: {name} in {module}.py ({bad_frag!r} -> {good_frag!r})."""\n'
    tests += TEST_HEAD.format(module=module)
    tests += _cases_test("test_fixed_behaviour", name, calls, want)
    tests += _companion_tests(rng, others, other_names)
    params = list(re.search(r"def NAME\((.*?)\)", spec.source).group(1).replace(" ", "").split(","))
    tests += f'''

def test_signature_is_kept():
    assert list(inspect.signature(load().{name}).parameters) == {params!r}
'''
    return Instance(instruction, {f"{module}.py": buggy_text},
                    _replace_script(f"{module}.py", [(bad_frag, good_frag)]), tests,
                    difficulty="medium", tags=("python", "debugging"), agent_timeout_s=300)


@family("implement-python-stub", skill="python", split="train")
def implement_python_stub(rng: random.Random) -> Instance:
    """A function whose body is a stub, to be written from its docstring."""
    spec = rng.choice(SPECS)
    others = _companions(rng, spec, rng.randint(1, 2))
    name, *other_names = _pick_names(rng, [spec, *others])
    good = _source(spec, name)
    head, doc_end = re.match(r'(def .*?""".*?"""\n)', good, re.DOTALL), None
    assert head is not None
    doc_end = head.group(1)
    stub = doc_end + "    raise NotImplementedError\n"
    module = rng.choice(MODULES)
    parts = [good if s is spec else _source(s, n)
             for s, n in zip([spec, *others], [name, *other_names])]
    rng.shuffle(parts)
    text = _module_text(rng, parts)
    calls = spec.inputs(rng)
    want = _run(good, name, calls)
    instruction = rng.choice((
        f"`{name}` in /app/{module}.py is only a stub. Implement it so that it does what "
        f"its docstring says; keep its name and parameters.",
        f"Write the body of the function `{name}` in /app/{module}.py (it currently raises "
        f"NotImplementedError), following its docstring. The other functions in the file "
        f"must keep working.",
        f"Finish /app/{module}.py: the function `{name}` has a docstring but no "
        f"implementation yet. Make it behave as documented.",
    ))
    tests = f'"""implement-python-stub: {name} in {module}.py."""\n'
    tests += TEST_HEAD.format(module=module)
    tests += _cases_test("test_implemented", name, calls, want)
    tests += _companion_tests(rng, others, other_names)
    return Instance(instruction, {f"{module}.py": text.replace(good, stub)},
                    _replace_script(f"{module}.py", [(stub, good)]), tests,
                    difficulty="easy", tags=("python", "implement"), agent_timeout_s=300)


@dataclass(frozen=True)
class Feature:
    """A function (`before`) and the same function with one more keyword argument KW
    (`after`, default DEFAULT); `describe` says what the argument does."""

    names: tuple[str, ...]
    kwargs: tuple[str, ...]
    before: str
    after: str
    default: object
    values: Callable[[random.Random], list]
    describe: str
    inputs: Callable[[random.Random], list[Args]]


FEATURES: tuple[Feature, ...] = (
    Feature(("join_words", "glue_words"), ("sep", "separator", "joiner"), '''
def NAME(words):
    """Return the words joined into one string, separated by single spaces."""
    return " ".join(words)
''', '''
def NAME(words, KW=DEFAULT):
    """Return the words joined into one string, separated by KW."""
    return KW.join(words)
''', " ", lambda r: r.sample(["-", ", ", "", "/", " | ", "_"], 2),
        "it is the string placed between the words, instead of the single space",
        lambda r: [(r.sample(NOUNS, r.randint(1, 5)),) for _ in range(4)]
        + [(r.sample(NAMES, 3),)]),
    Feature(("count_vowels", "vowel_count"), ("include_y", "count_y", "y_is_vowel"), '''
def NAME(text):
    """Return how many of the letters a, e, i, o, u (either case) text contains."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', '''
def NAME(text, KW=DEFAULT):
    """Return how many of the letters a, e, i, o, u (either case) text contains; when
    KW is true the letter y counts as a vowel too."""
    vowels = "aeiouy" if KW else "aeiou"
    return sum(1 for ch in text.lower() if ch in vowels)
''', False, lambda r: [True],
        "when it is true, the letter y (either case) is counted as a vowel as well",
        lambda r: [(" ".join(r.sample(NOUNS + NAMES, 3)) + r.choice(("y", "Y", " yes")),)
                   for _ in range(4)] + [("rhythm sky",)]),
    Feature(("count_words", "word_total"), ("min_length", "min_len", "shortest"), '''
def NAME(text):
    """Return the number of whitespace-separated words in text."""
    return len(text.split())
''', '''
def NAME(text, KW=DEFAULT):
    """Return the number of whitespace-separated words in text that have at least KW
    characters."""
    return sum(1 for w in text.split() if len(w) >= KW)
''', 1, lambda r: r.sample([3, 4, 5, 6, 7], 2),
        "only words of at least that many characters are counted",
        lambda r: [(_text(r) + " a an the",) for _ in range(4)]),
    Feature(("mean", "average_of"), ("ndigits", "digits", "places"), '''
def NAME(values):
    """Return the arithmetic mean of values (a non-empty list of numbers)."""
    return sum(values) / len(values)
''', '''
def NAME(values, KW=DEFAULT):
    """Return the arithmetic mean of values (a non-empty list of numbers), rounded with
    round() to KW decimal places when KW is not None."""
    result = sum(values) / len(values)
    if KW is not None:
        result = round(result, KW)
    return result
''', None, lambda r: [1, 2],
        "when it is not None, the mean is rounded with the built-in round() to that many "
        "decimal places",
        lambda r: [([r.randint(0, 100) for _ in range(r.choice((3, 6, 7)))],) for _ in range(4)]
        + [([1, 2, 2],)]),
    Feature(("greet", "greeting_for"), ("greeting", "salutation", "word"), '''
def NAME(name):
    """Return a greeting for name, such as "Hello, Ada!"."""
    return f"Hello, {name}!"
''', '''
def NAME(name, KW=DEFAULT):
    """Return a greeting for name, such as "Hello, Ada!", using KW as the greeting word."""
    return f"{KW}, {name}!"
''', "Hello", lambda r: r.sample(["Hi", "Welcome", "Good morning", "Hey"], 2),
        "it is the word used instead of \"Hello\" (the result keeps the form "
        "\"<word>, <name>!\")",
        lambda r: [(n.capitalize(),) for n in r.sample(NAMES, 4)]),
    Feature(("largest", "top_values"), ("smallest", "lowest", "reverse"), '''
def NAME(values, n):
    """Return the n largest numbers of values, largest first."""
    return sorted(values, reverse=True)[:n]
''', '''
def NAME(values, n, KW=DEFAULT):
    """Return the n largest numbers of values, largest first; when KW is true, the n
    smallest instead, smallest first."""
    return sorted(values, reverse=not KW)[:n]
''', False, lambda r: [True],
        "when it is true, the function returns the n smallest numbers instead, smallest first",
        lambda r: [(_ints(r, -50, 50, (5, 9)), r.randint(1, 4)) for _ in range(4)]),
)


@family("add-keyword-argument", skill="python", split="heldout")
def add_keyword_argument(rng: random.Random) -> Instance:
    """A new optional keyword argument added to a function, old calls unchanged."""
    feat = rng.choice(FEATURES)
    name = rng.choice(feat.names)
    kw = rng.choice(feat.kwargs)
    before = feat.before.replace("NAME", name).strip("\n") + "\n"
    after = (feat.after.replace("NAME", name).replace("KW", kw)
             .replace("DEFAULT", repr(feat.default)).strip("\n") + "\n")
    others = rng.sample([s for s in SPECS if not set(s.names) & set(feat.names)],
                        rng.randint(1, 2))
    other_names = _pick_names(rng, others)
    module = rng.choice(MODULES)
    parts = [before, *(_source(s, n) for s, n in zip(others, other_names))]
    rng.shuffle(parts)
    text = _module_text(rng, parts)
    calls = feat.inputs(rng)
    plain = _run(before, name, calls)
    assert plain == _run(after, name, calls)
    instruction = rng.choice((
        f"Add an optional keyword argument `{kw}` to the function `{name}` in "
        f"/app/{module}.py, with default {feat.default!r}: {feat.describe}. Calls that do "
        f"not pass `{kw}` must behave exactly as before.",
        f"Extend `{name}` (in /app/{module}.py) with a new parameter `{kw}={feat.default!r}`; "
        f"{feat.describe}. Existing callers that leave it out must get the same results "
        f"as today, and the rest of the module must keep working.",
        f"`{name}` in /app/{module}.py needs a `{kw}` keyword argument (default "
        f"{feat.default!r}, keeping today's behaviour): {feat.describe}. Update the "
        f"docstring if you like, but do not rename the function or its existing "
        f"parameters.",
    ))
    tests = f'"""add-keyword-argument: {name}(..., {kw}={feat.default!r}) in {module}.py."""\n'
    tests += TEST_HEAD.format(module=module)
    tests += _cases_test("test_default_behaviour_unchanged", name, calls, plain)
    for i, value in enumerate(feat.values(rng)):
        kwargs = {kw: value}
        want = _run(after, name, calls, kwargs)
        assert want != plain
        tests += _cases_test(f"test_{kw}_{i}", name, calls, want, kwargs)
    tests += f'''

def test_{kw}_defaults_to_old_behaviour():
    p = inspect.signature(load().{name}).parameters["{kw}"]
    assert p.default == {feat.default!r}
'''
    tests += _companion_tests(rng, others, other_names)
    return Instance(instruction, {f"{module}.py": text},
                    _replace_script(f"{module}.py", [(before, after)]), tests,
                    difficulty="medium", tags=("python", "feature"), agent_timeout_s=300)


def _args(call: Args) -> str:
    return ", ".join(map(repr, call))


_VAGUE = ("do_it", "helper", "process", "calc", "func", "handle", "compute", "run_step",
          "util")


@family("rename-python-function", skill="python", split="heldout")
def rename_python_function(rng: random.Random) -> Instance:
    """A function renamed across a small project: its definition and every call site."""
    spec, other = rng.sample(SPECS, 2)
    new = rng.choice(spec.names)
    other_name = rng.choice(other.names)
    old = f"{rng.choice(_VAGUE)}{rng.randint(1, 9)}"
    module = rng.choice(MODULES)
    script = rng.choice(("report", "main", "app", "cli"))
    calls = spec.inputs(rng)[:3]
    good = _source(spec, old)
    wrapper = rng.choice(("twice", "both", "pair"))
    lib = _module_text(rng, [
        good, _source(other, other_name),
        f'def {wrapper}(*args):\n    """{old}(*args) computed twice, as a pair."""\n'
        f"    return ({old}(*args), {old}(*args))\n",
    ])
    style = rng.random() < 0.5
    if style:
        imp = f"from {module} import {old}, {wrapper}\n"
        body = "".join(f"        {old}({_args(c)}),\n" for c in calls)
        wrap = f"{wrapper}({_args(calls[0])})"
    else:
        imp = f"import {module}\n"
        body = "".join(f"        {module}.{old}({_args(c)}),\n" for c in calls)
        wrap = f"{module}.{wrapper}({_args(calls[0])})"
    main = (f'"""Prints a small report."""\n\n{imp}\n\ndef summary():\n    return [\n{body}'
            f"        {wrap},\n    ]\n\n\nif __name__ == \"__main__\":\n"
            f"    for line in summary():\n        print(line)\n")
    results = _run(good, old, calls)
    expected = [*results, (results[0], results[0])]
    files = {f"{module}.py": lib, f"{script}.py": main}
    assert all(len(re.findall(rf"\b{old}\b", t)) >= 2 for t in files.values())
    instruction = rng.choice((
        f"Rename the function `{old}` in /app/{module}.py to `{new}`. Update every place "
        f"that uses it (in that module and in the other Python files of /app) so that "
        f"the code keeps working; the old name should not remain anywhere.",
        f"`{old}` is a poor name for the function defined in /app/{module}.py. Call it "
        f"`{new}` instead, everywhere it is defined, imported, called or mentioned in "
        f"/app, without changing what the code does.",
        f"Give the function `{old}` (defined in /app/{module}.py) the new name `{new}`, and "
        f"fix all of its uses across /app/*.py accordingly. No reference to `{old}` may be "
        f"left.",
    ))
    other_calls = other.inputs(rng)
    tests = f'"""rename-python-function: {old} -> {new} in {module}.py and {script}.py."""\n'
    tests += TEST_HEAD.format(module=module)
    tests += _cases_test("test_new_name_works", new, calls, results)
    tests += _cases_test(f"test_{other_name}_still_works", other_name, other_calls,
                         _run(_source(other, other_name), other_name, other_calls))
    tests += f'''

def test_old_name_is_gone():
    assert not hasattr(load(), "{old}")
    import re
    for p in Path("/app").glob("*.py"):
        assert not re.search(r"\\b{old}\\b", p.read_text()), f"{old} is still used in {{p}}"


def test_callers_still_work():
    assert load("{script}").summary() == {expected!r}
    assert load().{wrapper}(*{calls[0]!r}) == {(results[0], results[0])!r}
'''
    solution = f"sed -i 's/\\b{old}\\b/{new}/g' {module}.py {script}.py\n"
    return Instance(instruction, files, solution, tests, difficulty="medium",
                    tags=("python", "refactor"), agent_timeout_s=300)
