"""The README's snippets run as written: its Python one is extracted and run (a tiny
run), its shell steps run in a fresh folder and leave nothing outside runs/ and
sweeps/, and its CI marker still introduces the test command .ci/run reads."""
from __future__ import annotations

import os
import re
import shutil
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


def shell_steps() -> list[str]:
    """The `fedemu` commands of the README's sh blocks, continuation lines joined and
    comments dropped; the set-up lines (venv, pip) are the CI's own business."""
    text = README.read_text()
    steps = []
    for block in re.findall(r"^ *```sh\n(.*?)^ *```", text, re.S | re.M):
        for line in textwrap.dedent(block).replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("fedemu "):
                steps.append(" ".join(line.split()))
    return steps


# What the test shortens, to keep the suite's minutes: the default job to one round, the
# sweep to FedAvg without stragglers (the points the README compares).
SHORTER = {"fedemu launch": "fedemu launch --set run.rounds=1"}
SWEEP_CUTS = {'"algorithm.name" = ["fedavg", "coop"]': '"algorithm.name" = ["fedavg"]',
              '"network.stragglers.distribution" = ["none", "classes"]': '"network.stragglers.distribution" = ["none"]'}


@pytest.mark.mnist
@pytest.mark.slow
def test_the_readmes_shell_steps_write_only_under_runs_and_sweeps(tmp_path):
    steps = shell_steps()
    assert len(steps) >= 8 and steps[0] == "fedemu launch"
    shutil.copytree(README.parent / "examples", tmp_path / "examples")
    sweep_file = tmp_path / "examples" / "sweeps" / "fedavg-coop-lte.toml"
    text = sweep_file.read_text()
    for old, new in SWEEP_CUTS.items():
        assert old in text, f"the sweep file no longer has {old!r}: update SWEEP_CUTS"
        text = text.replace(old, new)
    sweep_file.write_text(text)
    before = {p.name for p in tmp_path.iterdir()}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "CI": "true"}
    for step in steps:
        done = subprocess.run(SHORTER.get(step, step), shell=True, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{step}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert {p.name for p in tmp_path.iterdir()} - before == {"runs", "sweeps"}
    # Where the README says each step writes:
    for written in ("runs/dropout/report/timeline.png", "runs/dropout/trace.json", "runs/population.csv.stats.png",
                    "sweeps/fedavg-coop-lte/report/report.md", "sweeps/fedavg-coop-lte/compare/compare.md"):
        assert (tmp_path / written).is_file(), written
