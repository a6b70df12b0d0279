"""The files of a run directory, by name: what the trainer writes and `zaya report`, `zaya eval` and the
supervisor read.

    run_config.json        the run config as resolved (every default, `--set` and `auto` decided)
    train.log              rank 0's messages; logs/rank-R.log the other ranks'
    metrics.jsonl          one row per logged step (zaya.train.metrics)
    samples.jsonl          with logging.record_samples: the global positions each step trained on
    incidents.jsonl        every decision on the training signals (zaya.resilience.incidents)
    evals.jsonl, evals/    evaluation results (zaya.evals.records)
    checkpoints/           step_N/ and `latest` (zaya.checkpoint)
    tensorboard/, wandb/, wandb-id.txt, report/, supervisor/
"""

RUN_CONFIG_FILE = "run_config.json"  # not config.json: that name marks a Hugging Face directory
CONFIG_HISTORY_FILE = "config_history.jsonl"  # what each resume changed in the run's settings
INIT_FROM_FILE = "init_from.json"  # the weights a run started from (train.init_from) and their fingerprint
LOG_FILE = "train.log"
RANK_LOG = "logs/rank-{}.log"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
INCIDENTS_FILE = "incidents.jsonl"
EVALS_FILE = "evals.jsonl"
EVALS_DIR = "evals"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-id.txt"
REPORT_DIR = "report"
SUPERVISOR_DIR = "supervisor"
