from pathlib import Path

import pytest

from fedemu.launch import config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


def test_there_are_examples_for_every_algorithm():
    from fedemu.common.algorithms.base import built_in

    names = {config.load(path)["algorithm"]["name"] for path in EXAMPLES}
    assert names == set(built_in())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_static_checks(path, monkeypatch):
    monkeypatch.chdir(path.parent.parent)  # trace files are named from the repository's root, where examples run
    config.load(path)  # raises ConfigError naming the key or the rule
