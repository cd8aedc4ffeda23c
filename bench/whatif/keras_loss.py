"""A what-if for Nilsson et al.'s Table 1 (docs/results.md): FedAvg's clients with the
loss their Keras clients computed, to test whether it explains fedemu's non-IID FedAvg
learning faster than theirs (best at 10 uploads per client above all 15 of their runs).

Their 2NN ends in a softmax, compiled with Keras 2.1's categorical cross-entropy (their
conda_environment.yaml: keras=2.1, tensorflow=1.10), which clips the probabilities to
[1e-7, 1 - 1e-7] before the log (TensorFlow backend): an
example whose label gets less than 1e-7 adds no gradient at all, where PyTorch's
cross-entropy on logits gives it a full one. On non-IID shards a client's examples can
be that far off under the global model; whether that happens often enough to matter is
what this measures. It is a data set plug-in (MNIST with that loss) so the run is
otherwise the benchmark's; it counts, per process, the training examples below 1e-7 when
FEDEMU_KERAS_COUNT names a file prefix (evaluations, which run without gradients, are
not counted).

    PYTHONPATH=bench/whatif FEDEMU_KERAS_COUNT=/tmp/kcount fedemu launch \\
        examples/fedavg-noniid-nilsson.toml --workers 2 --set data.folds=5 --set data.fold=0 \\
        --set run.seed=1 --set data.partition=shards --set data.shard_order=pixels \\
        --set run.max_uploads_per_client=10 --set data.dataset=keras_loss:KerasLossMnist
    cat /tmp/kcount.* | awk '{below += $1; all += $2} END {print below, all}'

The data set has its own name, so its first run caches MNIST again under it.
"""
from __future__ import annotations

import os

from fedemu.common.ml.datasets.mnist import Mnist

_EPSILON = 1e-7  # Keras 2's backend epsilon()


class KerasLossMnist(Mnist):
    name = "mnist-keras-loss"

    def loss(self, logits, targets, reduction: str = "mean"):
        import torch

        probabilities = torch.softmax(logits, -1)
        probabilities = probabilities / probabilities.sum(-1, keepdim=True)  # as Keras renormalises
        picked = probabilities.gather(1, targets[:, None])[:, 0]
        if os.environ.get("FEDEMU_KERAS_COUNT") and torch.is_grad_enabled():
            with open(f"{os.environ['FEDEMU_KERAS_COUNT']}.{os.getpid()}", "a") as counts:
                counts.write(f"{int((picked < _EPSILON).sum())} {picked.numel()}\n")
        # clamp, like tf.clip_by_value, passes no gradient outside the range
        losses = -torch.log(picked.clamp(_EPSILON, 1 - _EPSILON))
        if reduction == "mean":
            return losses.mean()
        return losses.sum() if reduction == "sum" else losses
