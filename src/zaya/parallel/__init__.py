"""Parallelism, applied from outside to a plain single-device model: the device mesh, FSDP2 / HSDP,
distributed Muon (owner ranks), and the accounting of what goes over the wire."""
