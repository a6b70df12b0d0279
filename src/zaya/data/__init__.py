"""zaya.data: text into tokenized datasets, and datasets into per-rank training batches.

    report = build_dataset(BuildOptions(inputs=("corpus/",), out=Path("data/mine")))   # zaya.data.build
    build_dataset(BuildOptions(inputs=("chats.jsonl",), out=Path("data/sft"), format="chat"))  # + a loss mask
    dataset = open_dataset("data/mine")          # zaya.data.dataset_reader: .fingerprint, .split("train"), ...
    ramp = BatchRamp(start=32, increment=32, final=256, ramp_samples=10_000)          # zaya.data.ramp
    with TokenLoader([("data/mine", 1.0)], seq_len=2048, seed=0, rank=rank, world_size=world) as loader:
        batch = loader.next_batch(ramp.at(loader.consumed_samples))   # [B // world, seq_len + 1] int64
"""
