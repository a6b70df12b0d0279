"""Parallelism, applied from outside to a plain single-device model: the device mesh, FSDP2 / HSDP, context
parallelism, and the accounting of what goes over the wire (distributed Muon's owner ranks are
`zaya.optim.distributed`)."""
