"""The planner's prediction for exactly the step `zaya.plan.measure.measured_step` runs, key by key, so that
tests and `benchmarks/plan_accuracy.py` set the two side by side."""

from __future__ import annotations

from dataclasses import dataclass

from zaya.config import RunConfig
from zaya.model.presets import ModelSection
from zaya.plan.devices import DeviceSpec, get_device
from zaya.plan.inventory import inventory
from zaya.plan.layout import Layout
from zaya.plan.memory import DeviceDetails, activation_bytes, state_bytes
from zaya.plan.planner import device_details, plan_run


@dataclass(frozen=True)
class Case:
    """One measured configuration: `world` ranks as dp_replicate x (world / dp_replicate / cp) x cp, the experts
    over `ep` of them."""

    preset: str
    precision: str
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    world: int = 1
    dp_replicate: int = 1
    cp: int = 1
    activation_checkpointing: str = "none"
    cp_kernel: str = "allgather"
    ep: int = 1

    @property
    def layout(self) -> Layout:
        return Layout(self.world, self.world, self.dp_replicate, self.world // self.dp_replicate // self.cp, self.cp,
                      self.micro_batch_size, self.activation_checkpointing, compiled=False,  # measured eagerly
                      ep=self.ep)

    def measure_kwargs(self) -> dict:
        """The arguments of `measured_step` for this case."""
        return {"preset": self.preset, "precision": self.precision, "seq_len": self.seq_len,
                "micro_batch_size": self.micro_batch_size, "micro_batches": self.micro_batches,
                "dp_replicate": self.dp_replicate, "cp": self.cp,
                "activation_checkpointing": self.activation_checkpointing, "cp_kernel": self.cp_kernel,
                "ep": self.ep}

    def run_config(self) -> RunConfig:
        """The run config whose step `measured_step` runs (Newton-Schulz in fp32, as it does)."""
        config = RunConfig()
        config.model = ModelSection(self.preset, {"temp_init": 1.0})
        config.data.seq_len = self.seq_len
        config.train.micro_batch_size = self.micro_batch_size
        config.train.global_batch_size = self.micro_batch_size * self.micro_batches * self.layout.dp
        config.train.precision = self.precision
        config.train.activation_checkpointing = self.activation_checkpointing
        config.optim.ns_dtype = "float32"
        config.parallel.dp_replicate, config.parallel.cp = self.dp_replicate, self.cp
        config.parallel.cp_kernel = self.cp_kernel
        config.parallel.ep = self.ep
        return config


# what tests/plan/test_accuracy.py and benchmarks/plan_accuracy.py measure: memory and traffic on 1 to 4 gloo
# ranks (FSDP2, HSDP, context parallelism, checkpointing, bf16, expert parallelism), and one process's step time
ACCURACY_CASES = (
    Case("tiny", "fp32", 64, 2, 2, world=1),
    Case("tiny", "fp32", 64, 2, 2, world=2, ep=2),
    Case("tiny", "fp32", 64, 2, 2, world=4),
    Case("small", "fp32", 64, 2, 1, world=1),
    Case("small", "fp32", 64, 2, 1, world=2),
    Case("small", "fp32", 64, 2, 1, world=4),
    Case("tiny", "fp32", 64, 2, 1, world=4, dp_replicate=2),
    Case("tiny", "fp32", 128, 2, 1, world=2, cp=2),
    Case("tiny", "fp32", 128, 2, 1, world=4, cp=2, cp_kernel="ring", activation_checkpointing="full"),
    Case("tiny", "bf16", 64, 2, 1, world=2, activation_checkpointing="moe"),
)
TIME_CASES = (Case("tiny", "fp32", 256, 4, 2), Case("small", "fp32", 256, 4, 1))

CPU_DETAILS = {"fp32": DeviceDetails(1, 1 << 21), "bf16": DeviceDetails(32, 1 << 21)}


def predicted_step(case: Case, rank: int = 0, device: DeviceSpec | None = None, table=None) -> dict:
    """{state, activations, comm, seconds} as the planner predicts them for `rank` of `case` (seconds only
    with a `table` or a `device`; the CPU's per-device choices otherwise, as `measured_step` runs there)."""
    run = case.run_config().resolve(case.world)
    model = run.model
    layout = case.layout
    # a rank's place in its FSDP group (dp_shard x cp, the innermost dimensions)
    parameters, gradients, optimizer = state_bytes(inventory(model), layout.shard_ranks,
                                                   rank % layout.shard_ranks, layout.ep)
    details = device_details(device, table.device, case.precision) if table is not None else CPU_DETAILS[
        case.precision]
    tokens = case.micro_batch_size * case.seq_len // case.cp
    saved, _ = activation_bytes(model, tokens, case.seq_len, case.cp, case.precision,
                                case.activation_checkpointing, details, case.ep)
    spec = device or (get_device("local", table) if table is not None else get_device("h100"))
    plan = plan_run(run, spec, table, case.world, layout)
    comm = {kind: nbytes for kind, nbytes in plan.first.traffic.by_kind.items() if kind != "trainer"}
    result = {"state": {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer},
              "activations": saved, "comm": comm}
    if table is not None or device is not None:
        result["seconds"] = plan.first.time.total
    return result
