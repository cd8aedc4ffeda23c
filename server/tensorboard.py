"""TensorBoard event files as a run goes (``run.tensorboard = true``): the scalars of each
round event (accuracy, loss, participation by outcome, the round's emulated duration,
bytes) and the run's config as text, in ``tensorboard/`` of the run directory, so
``tensorboard --logdir runs/`` (or a sweep's ``runs/``) shows runs side by side.

Written with tensorboardX, which needs neither TensorFlow nor the TensorBoard server.
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("fedemu.server")

FOLDER = "tensorboard"

# Round event field -> TensorBoard tag. Tags group by their first part in TensorBoard's view.
SCALARS = {
    "accuracy": "accuracy/test",
    "loss": "loss/test",
    "train_loss": "loss/train",
    "round_emulated_s": "time/round_emulated_s",
    "emulated_s": "time/emulated_s",
    "bytes_up": "bytes/up",
    "bytes_down": "bytes/down",
    "participants": "participation/participants",
    # asynchronous rules' evaluations
    "uploads": "participation/uploads",
    "merges": "participation/merges",
    "staleness_max": "staleness/max",
}


class TensorBoardLog:
    """Turns the server's round events into TensorBoard scalars (step: the round, or the
    evaluation for asynchronous rules), flushed after each."""

    def __init__(self, run_dir: str | Path, config_text: str) -> None:
        # optional: imported only when run.tensorboard asks for event files
        from tensorboardX import SummaryWriter

        self.folder = Path(run_dir) / FOLDER
        self._writer = SummaryWriter(str(self.folder), flush_secs=10)
        # Four spaces: TensorBoard renders text as Markdown; indented, the TOML stays as written.
        self._writer.add_text("config", "\n".join("    " + line for line in config_text.splitlines()), 0)
        self._writer.flush()

    def on_event(self, event: dict) -> None:
        if event.get("event") != "round" or self._writer is None:
            return
        step = event["round"]
        try:
            for field, tag in SCALARS.items():
                value = event.get(field)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(tag, value, step)
            for outcome, count in (event.get("outcome_counts") or {}).items():
                self._writer.add_scalar(f"participation/{outcome}", count, step)
            self._writer.flush()
        except OSError as exc:  # TensorBoard is a view: its failure must not end the run
            log.warning("TensorBoard logging stopped: %s", exc)
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError:
                pass
            self._writer = None
