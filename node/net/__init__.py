"""The emulated network, with no sockets: each client's links (profiles, presets,
availability), how a message crosses them (the ``message`` pipe; the ``tcp`` transport),
and the link emulator that owns their state and books for the broker."""
