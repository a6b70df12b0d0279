"""A training step reads the device once: its statistics, summed over the ranks in one all-reduce and copied
back in one piece, which also decide whether the optimizer steps (a non-finite norm skips it). Nothing else
in the step (micro-batches, clipping, Muon and AdamW, the balancing controller) waits for the device, so on an
accelerator the host queues the next step's kernels while the last ones run. Counted on the CPU."""

from host_syncs import HostSyncs
from runs import write_config
from zaya.config import load_config
from zaya.train.stats import StepStats
from zaya.training import build_trainer


def test_a_training_step_reads_the_device_once(dataset, tmp_path, monkeypatch):
    config = write_config(tmp_path / "run.toml", dataset, model={"preset": "micro", "num_hidden_layers": 4},
                          train={"max_steps": 3, "eval_every": 0, "micro_batch_size": 4, "global_batch_size": 8},
                          balance={"enabled": True}, logging={"log_every": 100}, checkpoint={"every": 100})
    trainer = build_trainer(load_config(config), tmp_path / "run")
    reads, syncs, step = [], [], trainer.train_step
    reduce = StepStats.reduce
    monkeypatch.setattr(StepStats, "reduce", lambda stats, all_reduce: reads.append(1) or reduce(stats, all_reduce))

    def adamw_step_counter(tensor):  # kept on the host by torch.optim, as here, on every device
        return any(state.get("step") is tensor for state in trainer.optimizer.state.values())

    def counted():
        reads.clear()
        with HostSyncs(adamw_step_counter) as ops:
            row = step()
        syncs.append((len(reads), ops.ops))
        return row

    monkeypatch.setattr(trainer, "train_step", counted)
    row = trainer.run()
    assert syncs == [(1, [])] * 3  # two micro-batches each
    assert row["grad_norm"] > 0 and row["optimizer_time"] > 0
