"""fizzbuzz: 1..30 with Fizz/Buzz/FizzBuzz."""

import subprocess
import sys


def expected():
    out = []
    for i in range(1, 31):
        out.append("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else
                   "Buzz" if i % 5 == 0 else str(i))
    return out


def test_output():
    r = subprocess.run([sys.executable, "/app/fizzbuzz.py"], capture_output=True, text=True,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == expected()
