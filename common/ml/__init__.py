"""fedemu.common.ml — the machine-learning library: data sets and partitions, models,
local training, evaluation, update compression and the device model. It runs no
process and sends no message: the client process (``fedemu.worker.client``) and the
server (``fedemu.server``) both call it."""
