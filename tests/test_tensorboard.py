"""TensorBoard logging (run.tensorboard): a run writes event files as it goes, and
TensorBoard's own reader finds the round scalars and the config in them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fedemu.server.runlog import read_events


@pytest.mark.mnist
def test_a_run_writes_tensorboard_event_files_with_the_round_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "1", "--tensorboard",
         "--set", "run.rounds=3", "--set", "run.target_accuracy=0", "--set", "data.clients=10",
         "--set", "data.partition=sample", "--set", "data.examples_per_client=50",
         "--set", "network.dropout.per_round=0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    reader = EventAccumulator(str(run_dir / "tensorboard"))
    reader.Reload()
    rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
    for tag, field in (("accuracy/test", "accuracy"), ("loss/test", "loss"), ("bytes/up", "bytes_up"),
                       ("time/round_emulated_s", "round_emulated_s")):
        scalars = reader.Scalars(tag)
        assert [s.step for s in scalars] == [e["round"] for e in rounds]
        assert [s.value for s in scalars] == pytest.approx([e[field] for e in rounds], rel=1e-6)
    for outcome in ("answered", "offline", "straggler"):
        assert [s.value for s in reader.Scalars(f"participation/{outcome}")] == \
            [e["outcome_counts"][outcome] for e in rounds]
    (config,) = reader.Tensors("config/text_summary")
    assert b"examples_per_client = 50" in config.tensor_proto.string_val[0]
