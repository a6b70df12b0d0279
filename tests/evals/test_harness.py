"""The native `zaya` lm_eval model against lm_eval's HF model on the export of the same trained run.

Both see the same requests; every metric must be equal, every loglikelihood within 1e-4 (fp32) and every
generated text the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
from lm_eval.api.instance import Instance

from zaya.errors import ZayaError
from zaya.evals.harness import ZayaLM

TASKS = Path(__file__).parent / "tasks"
# `python -m zaya.evals ARGS`, with lm_eval's TaskManager told not to index lm_eval's own tasks
CLI_WITHOUT_DEFAULT_TASKS = """
import functools, sys
import lm_eval.tasks
lm_eval.tasks.TaskManager.__init__ = functools.partialmethod(lm_eval.tasks.TaskManager.__init__,
                                                             include_defaults=False)
from zaya.evals.__main__ import main
sys.exit(main())
"""
TASK_NAMES = ["zaya_code_choice", "zaya_code_complete"]
TEXTS = ["def decode(self, s):\n    return self.raw_decode(s)[0]\n", "import json", "x",
         "class JSONEncoder(object):\n    item_separator = ', '\n    key_separator = ': '\n"]


def _hf_lm(directory, **kwargs):
    """lm_eval's HF model on an export, one request at a time (it needs lm_eval's `hf` extra: accelerate)."""
    pytest.importorskip("accelerate", reason="lm_eval --model hf needs lm_eval[hf] (accelerate)")
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=1, **kwargs)


@pytest.fixture(scope="module")
def hf_lm(hf_export):
    return _hf_lm(hf_export)


@pytest.fixture(scope="module")
def zaya_lm(trained_run):
    return ZayaLM(path=str(trained_run), device="cpu", batch_size=4)  # batched and padded, against HF's one by one


def _metrics(results: dict) -> dict:
    return {task: {k: v for k, v in values.items() if "," in k} for task, values in results["results"].items()}


def test_the_native_model_scores_the_tasks_exactly_as_lm_eval_hf_on_the_export(zaya_lm, hf_lm, task_manager,
                                                                                in_tasks_dir):
    ours = lm_eval.simple_evaluate(model=zaya_lm, tasks=TASK_NAMES, task_manager=task_manager, log_samples=True)
    theirs = lm_eval.simple_evaluate(model=hf_lm, tasks=TASK_NAMES, task_manager=task_manager, log_samples=True)
    assert _metrics(ours) == _metrics(theirs)
    assert set(_metrics(ours)["zaya_code_choice"]) >= {"acc,none", "acc_norm,none"}
    assert "exact_match,none" in _metrics(ours)["zaya_code_complete"]
    choice = list(zip(ours["samples"]["zaya_code_choice"], theirs["samples"]["zaya_code_choice"], strict=True))
    assert len(choice) == 12
    for a, b in choice:
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"]),
                                                      strict=True):
            assert abs(ll_a - ll_b) < 1e-4 and greedy_a == greedy_b
    generated = [(a["resps"], b["resps"]) for a, b in zip(ours["samples"]["zaya_code_complete"],
                                                          theirs["samples"]["zaya_code_complete"], strict=True)]
    assert [a for a, _ in generated] == [b for _, b in generated]
    # the stop strings were reached: some generations end before max_gen_toks
    assert any(len(zaya_lm.tok_encode(a[0][0])) < 12 for a, _ in generated)


def test_rolling_and_empty_context_loglikelihoods_match_lm_eval_hf(trained_run, hf_export):
    # a short max_length makes every text several rolling windows
    ours = ZayaLM(path=str(trained_run), device="cpu", batch_size=3, max_length=8)
    theirs = _hf_lm(hf_export, max_length=8)
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(TEXTS)]
    assert len(ours.tok_encode(TEXTS[0])) > 3 * 8
    for a, b in zip(ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling), strict=True):
        assert abs(a - b) < 1e-4
    pairs = [Instance("loglikelihood", {}, (context, continuation), i)
             for i, (context, continuation) in enumerate([("", "import json"), ("import", " json"),
                                                          ("def f(x): ", "return x"), (TEXTS[3], " = 1")])]
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(pairs), theirs.loglikelihood(pairs), strict=True):
        assert abs(a - b) < 1e-4 and greedy_a == greedy_b


def test_generation_stops_at_the_first_stop_string_and_after_max_gen_toks(zaya_lm):
    def request(context, **kwargs):
        return Instance("generate_until", {}, (context, {"do_sample": False, **kwargs}), 0)

    prompts = ["import", "class JSONEncoder(", "def f"]  # two of one token length, one of another
    full = zaya_lm.generate_until([request(p, until=[], max_gen_toks=16) for p in prompts])
    assert all(full)
    short = zaya_lm.generate_until([request(p, until=[], max_gen_toks=3) for p in prompts])
    for text, prefix in zip(full, short, strict=True):
        assert text.startswith(prefix) and len(zaya_lm.tok_encode(prefix)) <= 3
    stop = full[1][len(full[1]) // 2:][:2]
    steps = []
    forward = zaya_lm.model.hidden_states
    zaya_lm.model.hidden_states = lambda *a, **k: steps.append(1) or forward(*a, **k)
    try:
        cut = zaya_lm.generate_until([request(prompts[1], until=[stop], max_gen_toks=16)])
    finally:
        del zaya_lm.model.hidden_states
    assert cut == [full[1].split(stop)[0]]
    assert len(steps) < 16  # stopped on the stop string, not after max_gen_toks


def test_model_arguments_are_checked_with_one_line(trained_run):
    with pytest.raises(ZayaError, match="exactly one of path"):
        ZayaLM()
    with pytest.raises(ZayaError, match="batch_size must be a positive integer"):
        ZayaLM(path=str(trained_run), batch_size="many")
    with pytest.raises(ZayaError, match="dtype"):
        ZayaLM(path=str(trained_run), dtype="int8")


@pytest.mark.slow
def test_lm_eval_finds_the_zaya_model_by_name(trained_run, task_manager, in_tasks_dir, tmp_path):
    by_name = lm_eval.simple_evaluate(model="zaya", model_args=f"path={trained_run},batch_size=4",
                                      tasks=["zaya_code_choice"], task_manager=task_manager, limit=4)
    assert by_name["results"]["zaya_code_choice"]["sample_len"] == 4
    # the lm_eval command line in a fresh process, with the zaya model registered; its TaskManager indexes
    # tasks/ alone, as the fixture's does (lm_eval's own thousands of tasks take most of half a minute)
    done = subprocess.run([sys.executable, "-c", CLI_WITHOUT_DEFAULT_TASKS, "--model", "zaya", "--model_args",
                           f"path={trained_run}", "--tasks", "zaya_code_choice", "--include_path", str(TASKS),
                           "--limit", "4", "--output_path", str(tmp_path / "out")],
                          cwd=TASKS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zaya_code_choice" in done.stdout and "acc" in done.stdout
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1
