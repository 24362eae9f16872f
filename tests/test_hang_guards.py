"""Tests assert behaviour, never speed: what a test waits on is guarded against a hang only
(``helpers.HANG_GUARD_S``, far above any run on a loaded machine), and reaching the guard fails the
test saying it was the time."""

import os
import re
import sys

import helpers
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

# a subprocess, a process's output or a worker waited on with a limit of its own, and an assertion on a
# duration: each makes a loaded machine fail a test that behaves
SPEED_LIMITS = (
    re.compile(r"subprocess\.run\((?:[^()]|\([^()]*\))*\btimeout\s*=", re.S),
    re.compile(r"\.communicate\([^)]*\btimeout\s*="),
    re.compile(r"\.join\(\s*timeout\s*="),
    re.compile(r"assert[^\n]*(?:elapsed|perf_counter|monotonic|time\.time)"),
)


def test_no_test_limits_speed():
    found = []
    for folder, _, names in os.walk(TESTS):
        for name in sorted(names):
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path in (os.path.join(TESTS, "helpers.py"), os.path.abspath(__file__)):
                continue
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            for pattern in SPEED_LIMITS:
                for match in pattern.finditer(text):
                    line = text.count("\n", 0, match.start()) + 1
                    found.append(f"{os.path.relpath(path, TESTS)}:{line}: {match.group(0).splitlines()[0]}")
    assert found == [], "use helpers.run_guarded / communicate_guarded / wait_guarded / join_guarded:\n" + "\n".join(
        found
    )


@pytest.mark.slow  # a fresh interpreter
def test_a_subprocess_past_the_hang_guard_fails_saying_it_was_the_time(monkeypatch):
    monkeypatch.setattr(helpers, "HANG_GUARD_S", 0.5)
    command = [sys.executable, "-c", "import sys, time; print('started', flush=True); time.sleep(60)"]
    with pytest.raises(pytest.fail.Exception) as failed:
        helpers.run_guarded(command, capture_output=True, text=True)
    message = str(failed.value)
    assert message.startswith(f"hang guard: the command {' '.join(command)} was still running after 0.5 s")
    assert "not a wrong result" in message
