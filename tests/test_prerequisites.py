"""The rule for tests that need what a host may lack (tests/conftest.py: needs,
missing_prerequisite): they skip and say why, but under CI (CI=true) they fail."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NEEDY = '''
from tests.conftest import missing_prerequisite, needs

@needs("needs a unicorn (apt-get install unicorn)")
def test_marked():
    pass

def test_found_missing_at_run_time():
    missing_prerequisite("cannot saddle the unicorn: permission denied")

@needs(None)
def test_has_what_it_needs():
    pass
'''


def outcome(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_needy.py").write_text(NEEDY)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rsfE", "-q", str(tmp_path / "test_needy.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_outside_ci_a_missing_prerequisite_skips_and_says_why(tmp_path):
    done = outcome(tmp_path, None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 2 skipped" in done.stdout
    assert "needs a unicorn (apt-get install unicorn)" in done.stdout
    assert "cannot saddle the unicorn: permission denied" in done.stdout


@pytest.mark.parametrize("ci", ["true", "TRUE"])
def test_under_ci_a_missing_prerequisite_fails_naming_it(tmp_path, ci):
    done = outcome(tmp_path, ci)
    assert done.returncode != 0
    # The marked test errs before its fixtures; the one that finds it missing fails.
    assert "1 failed, 1 passed, 1 error" in done.stdout, done.stdout
    assert "CI=true, but this test cannot run: needs a unicorn (apt-get install unicorn)" in done.stdout
    assert "CI=true, but this test cannot run: cannot saddle the unicorn: permission denied" in done.stdout
