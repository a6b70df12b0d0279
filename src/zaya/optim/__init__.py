"""Optimizers: Muon (batched Newton-Schulz, `muon`, `ns_iteration`; owner ranks under sharding, `distributed`) for
the matrices, AdamW for the rest (`hybrid`), their settings (`config`) and learning-rate schedules (`schedule`)."""
