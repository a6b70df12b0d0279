"""The sections of a run config that the trainer owns: `[train]`, `[balance]`, `[checkpoint]`, `[logging]` and
the curriculum's `[[phases]]` (plain settings, read without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zaya.data.config import Source

PRECISIONS = ("bf16", "fp32", "auto")
COMPILE_CHOICES = (True, False, "auto")
WANDB_MODES = ("", "online", "offline", "disabled")


@dataclass
class TrainSection:
    seed: int = 0  # seeds the model's initialisation and the data order
    max_steps: int = 100  # optimizer steps to train for (and schedule.total_steps unless that is set)
    micro_batch_size: int = 8  # sequences per rank per forward/backward; steps accumulate over them
    global_batch_size: int = 8  # sequences per optimizer step once any ramp is over
    # "bf16" (autocast, fp32 master weights), "fp32", or "auto": bf16 on accelerators and on CPUs whose bf16
    # matmuls are fast (measured at start), fp32 on the CPUs that emulate bf16 (~100x slower there), where
    # Newton-Schulz then runs in fp32 too (optim.ns_dtype). "auto" by default: a config written for a GPU
    # trains at the speed of the machine it is tried on first
    precision: str = "auto"
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_every: int = 50  # steps between held-out evaluations; 0 disables
    eval_batches: int = 8  # global batches of held-out windows in each evaluation
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    # torch.compile each block, one graph per block (fuses the elementwise work, launches fewer kernels; costs
    # a compilation at start, needs a C++ compiler on CPUs and Triton on GPUs); "auto": on accelerators, off
    # on CPUs, where the 8-12% a step it saves pays for its minute or so only after 100-500 steps (docs/speed.md)
    compile: bool | str = "auto"
    # TF32 tensor cores for the fp32 matmuls that remain (the routers, the fp32 LM head, any fp32 run); no
    # effect on CPUs
    tf32: bool = True
    # recompute activations in backward instead of keeping them: "none", "full" (every block keeps only its
    # input) or "moe" (the MoE sublayers, whose expert activations are the largest)
    activation_checkpointing: str = "none"
    # a wall-clock limit on this process (a scheduler's, minus a margin): before it, the run writes a checkpoint
    # and exits with code 75 (EXIT_PREEMPTED) so that the resubmitted job resumes; 0: none
    max_time_s: float = 0.0
    # train for this much wall time in all (start-up, steps, evaluations and checkpoints, summed over resumes)
    # instead of to max_steps, which stays a cap: the wsd decay begins when the budget's last
    # `schedule.decay_fraction` begins, spans the remaining time at the measured pace, and the run ends with it;
    # 0: none
    time_budget_s: float = 0.0
    # after SIGTERM or SIGUSR1 the run finishes its step, writes a checkpoint and exits 75; a process that has not
    # managed that after this long (blocked in I/O, in a collective) exits without one (128 + the signal); 0: wait
    # for as long as it takes
    stop_grace_s: float = 600.0
    # start from these weights instead of a random initialisation: a Hugging Face directory (native or ZAYA1-base's
    # legacy layout), a zaya checkpoint, or a run directory (its newest valid checkpoint). The weights only: the
    # optimizer, the schedule and the step start afresh. A resumed run keeps its own checkpoint's. "": none
    init_from: str = ""


@dataclass
class BalanceSection:
    """The balancing-bias controller (spec section 5.3): PID on the per-layer expert load error."""

    kp: float = 0.0  # proportional gain on the load error
    ki: float = 1e-3  # integral gain: the step of the accumulated error term
    kd: float = 0.0  # derivative gain on the change of the error
    # "linear": the integral term adds ki * error (the PID form); "sign": adds ki * sign(error), which with
    # kp = kd = 0 is DeepSeek-V3's loss-free balancing.
    error: str = "linear"
    enabled: bool = True  # false: the balancing biases are never updated


@dataclass
class CheckpointSection:
    dir: str = ""  # default: RUN_DIR/checkpoints
    every: int = 100  # steps between checkpoints; the last step is always saved
    keep: int = 3  # the newest checkpoints kept; older ones are deleted
    async_save: bool = False  # stage the tensors in memory and write them while training goes on
    # a save or a load of a checkpoint that takes longer than this ends the process with one line (hung storage
    # would otherwise hold every rank for ever); the run resumes from its last committed checkpoint; 0: no limit
    timeout_s: float = 3600.0


@dataclass
class LoggingSection:
    log_every: int = 1  # steps between logged metric rows
    tensorboard: bool = True  # write TensorBoard events to the run directory
    progress: bool = True  # a progress bar on rank 0
    # append each step's global sample positions to RUN_DIR/samples.jsonl: a record of what was trained on
    record_samples: bool = False
    # Weights & Biases (the optional `wandb` extra): config and metrics as they are logged, the report's plots at
    # the end; a resumed run continues the same W&B run
    wandb: bool = False
    wandb_project: str = "zaya"  # the W&B project
    wandb_name: str = ""  # default: the run directory's name
    wandb_mode: str = ""  # "online", "offline" or "disabled"; default: WANDB_MODE, else online


@dataclass
class Phase:
    """One stage of the curriculum; it ends once `tokens` tokens were trained in it (0: never)."""

    name: str = "main"  # unique; names the phase in logs and checkpoints
    tokens: int = 0  # tokens to train in this phase; 0: no limit (only the last phase)
    sources: list[Source] = field(default_factory=list)  # the mixture ([[phases.sources]]); empty: [data.path]
    seq_len: int = 0  # 0: data.seq_len
    lr_scale: float = 1.0  # multiplies the schedule inside this phase
    rope_theta: float = 0.0  # 0: keep the model's
    cp: int = 0  # context-parallel ranks per sequence in this phase; 0: parallel.cp
    isolate_documents: bool | None = None  # keep packed documents apart (an SFT phase); unset: data's
    # the mean tokens per document `zaya plan` assumes for a phase that keeps documents apart: its attention
    # work is about seq_len x document_tokens / 2 pairs a row instead of seq_len^2 / 2 (docs/planning.md);
    # 0: the phase datasets' manifests (num_tokens / num_documents) where they are found, else the whole row
    document_tokens: int = 0
    # start this phase from these weights (as train.init_from takes them) with a fresh optimizer, e.g. SFT from
    # another model after continued pre-training; "": go on from the previous phase's weights
    init_from: str = ""
