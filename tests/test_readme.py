"""The README's snippets run as written: its Python one is extracted and run (a tiny
run), and its CI marker still introduces the test command .ci/run reads."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_snippets() -> list[str]:
    text = README.read_text()
    return [textwrap.dedent(block) for block in re.findall(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)]


@pytest.mark.mnist
def test_the_readmes_python_snippet_runs_as_written(tmp_path):
    (snippet,) = python_snippets()
    (tmp_path / "snippet.py").write_text(snippet + '\nprint("rows", len(rows))\n')
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["1", "2", "3"]  # round, accuracy, outcome counts
    assert "'answered'" in lines[0]
    assert lines[3:] == ["completed", "rows 3"]


def test_the_ci_marker_introduces_the_test_command():
    text = README.read_text()
    after = text.split("<!-- ci: test command -->\n", 1)[1]
    assert after.startswith("```sh\n") and "pytest" in after.split("```", 2)[1]
