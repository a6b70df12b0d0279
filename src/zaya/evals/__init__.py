"""zaya.evals: evaluating models, by held-out loss and through lm-evaluation-harness (the optional `eval` extra).

    heldout.py   `zaya eval --data`: held-out loss and perplexity of a model on a dataset split
    harness.py   the `zaya` model of lm_eval (`ZayaLM`): zaya's own loading, batching and decode cache
    run.py       `zaya eval --tasks`: run tasks, write the results JSON and the run's evals.jsonl line
    records.py   the run directory of a model, its step, and the evals.jsonl log that `zaya report` reads

Importing `zaya.evals.harness` registers `--model zaya` with lm_eval; `python -m zaya.evals ARGS` is the
`lm_eval` command with it registered (lm_eval 0.4.13 discovers no models from other packages).
"""
