"""Every `zaya` tool on a model with sliding-window blocks that transformers saved: a `ZayaForCausalLM` whose
`layer_types` mix "hybrid" and "hybrid_sliding", with a window of 6 positions and a RoPE of its own per type
(nested `rope_parameters`), its weights moved off their initial values. `params`, `generate` (against
transformers' greedy loop), `convert` both ways (bit-exact, and a config.json transformers reads back the same),
`train.init_from` and `eval` (against transformers' loss); and config.json's and [model]'s bad sliding settings,
each one line.

What transformers 5 makes of the same bad config.json (its `ZayaConfig` is the reference, not the bar):
- a `layer_types` entry of neither type, `sliding_window` missing with sliding blocks, a window that is not an
  integer (6.5, "6", true), a `layer_types` list of the wrong length: refused when the config is read;
- a window of 0 or -3: read, and the model fails at its first forward pass (a shape mismatch in its mask);
- `rope_parameters` without a "hybrid_sliding" entry while blocks slide: read, and building the model fails
  (KeyError 'hybrid_sliding'); the flat form (one set of parameters, no types) fails so even where every block
  is "hybrid" (KeyError 'hybrid'), which zaya reads as the "hybrid" blocks' parameters;
- a rope_type "linear" or "yarn": read and applied (a scaled RoPE); zaya applies the "default" RoPE only;
- a stray top-level "rope_type" beside the nested entries (as the ZAYA1-8B hub config has): dropped by its
  config class, ignored by zaya alike.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

import zaya
from runs import write_config
from zaya.config import load_config
from zaya.data.loader import TokenLoader
from zaya.data.loss_mask import inputs_and_targets
from zaya.data.tokenizer import TOKENIZER_FILE
from zaya.model.loss import IGNORE_INDEX
from zaya.train.metrics import read_metrics
from zaya.weights import WeightSource

WINDOW = 6
LAYER_TYPES = ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding"]
ROPE = {"hybrid": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        "hybrid_sliding": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}}
SHAPE = dict(vocab_size=512, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=3, moe_intermediate_size=16, router_hidden_size=8, max_position_embeddings=256)
# the same model as a run config's [model]: the shape, the types, the window and each type's RoPE
MODEL_SECTION = {"preset": "micro", **SHAPE, "layer_types": LAYER_TYPES, "sliding_window": WINDOW,
                 "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5, "sliding_rope_theta": 10_000.0,
                 "sliding_partial_rotary_factor": 0.25}


@pytest.fixture(scope="module")
def saved(dataset, tmp_path_factory):
    """(transformers' model, the directory it saved itself to, with the dataset's tokenizer beside it)."""
    torch.manual_seed(0)
    config = transformers.ZayaConfig(**SHAPE, layer_types=LAYER_TYPES, sliding_window=WINDOW, rope_parameters=ROPE)
    model = transformers.ZayaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    directory = tmp_path_factory.mktemp("sliding") / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    shutil.copy(dataset / TOKENIZER_FILE, directory / TOKENIZER_FILE)
    return model, directory


@torch.no_grad()
def _their_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """transformers' summed next-token cross-entropy over the kept targets, and their count."""
    logits = model(inputs).logits.float()
    kept = targets != IGNORE_INDEX
    return float(F.cross_entropy(logits[kept], targets[kept], reduction="sum")), int(kept.sum())


def test_params_counts_what_transformers_holds(cli, saved):
    model, directory = saved
    code, out, err = cli("params", directory, "--json")
    assert code == 0, err
    assert json.loads(out)["total"] == sum(p.numel() for p in model.parameters())  # the tied head counted once


@torch.no_grad()
def test_generate_is_transformers_greedy_past_the_window(cli, saved):
    model, directory = saved
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, 2 * WINDOW - 1), generator=torch.Generator().manual_seed(1))
    new = 2 * WINDOW  # the cache of each sliding block wraps round its W slots twice
    code, out, err = cli("generate", "--model", directory, "--prompt-ids", ",".join(map(str, prompt[0].tolist())),
                         "--greedy", "--max-new-tokens", new, "--output", "ids", "--no-stop-at-eos")
    assert code == 0, err
    sequence = prompt  # transformers without a cache: each step the whole sequence, the window applied by its mask
    for _ in range(new):
        sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.strip() == ",".join(map(str, sequence[0, prompt.shape[1]:].tolist()))


def test_convert_round_trip_is_bit_exact_and_transformers_reads_the_same_config(cli, saved, tmp_path):
    _, directory = saved
    code, out, err = cli("convert", directory, tmp_path / "ckpt")
    assert code == 0 and "hf->zaya" in out, err
    code, out, err = cli("convert", tmp_path / "ckpt", tmp_path / "back")
    assert code == 0 and "zaya->hf" in out, err
    theirs, ours = load_file(directory / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(theirs) == set(ours)
    for key in theirs:
        assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = transformers.ZayaConfig.from_pretrained(directory)
        after = transformers.ZayaConfig.from_pretrained(tmp_path / "back")
    assert after.layer_types == before.layer_types == LAYER_TYPES
    assert after.sliding_window == before.sliding_window == WINDOW
    assert after.rope_parameters == before.rope_parameters == ROPE


def test_a_run_starts_from_the_directory_with_transformers_loss(cli, saved, dataset, tmp_path):
    model, directory = saved
    config = write_config(tmp_path / "run.toml", dataset, model=MODEL_SECTION,
                          train={"max_steps": 2, "eval_every": 0, "init_from": str(directory)},
                          schedule={"warmup_steps": 1, "decay_fraction": 0.5})
    code, _, err = cli("train", config, "--run-dir", tmp_path / "run")
    assert code == 0, err
    run = load_config(config)
    with TokenLoader([(dataset, 1.0)], run.data.seq_len, run.train.seed, block_size=run.data.block_size,
                     group_blocks=run.data.group_blocks) as loader:
        batch = loader.next_batch(run.train.global_batch_size)  # the run's first global batch
    total, count = _their_loss(model, batch[:, :-1], batch[:, 1:])
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(total / count, rel=1e-5)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "initialised from" in log and "the run uses its own" not in log  # its sliding fields are the run's


def test_init_from_notes_the_sliding_fields_only_where_they_change_the_model(saved, dataset, tmp_path):
    _, directory = saved
    source = WeightSource.open(directory)
    run = load_config(write_config(tmp_path / "same.toml", dataset, model=MODEL_SECTION)).model_config()
    assert source.check_fits(run, "train.init_from") == []
    other = {**MODEL_SECTION, "layer_types": ["hybrid"] * 4, "sliding_window": 8}
    run = load_config(write_config(tmp_path / "other.toml", dataset, model=other)).model_config()
    notes = source.check_fits(run, "train.init_from")
    assert [note.split(" is ")[0] for note in notes] == [
        f"train.init_from: model.{name}" for name in ("layer_types", "sliding_window", "sliding_rope_theta",
                                                        "sliding_partial_rotary_factor")]
    # an all-hybrid export lists its types and both RoPE entries; a run that leaves them unset is the same model
    zaya.export_hf(zaya.build_model("micro", seed=0), tmp_path / "micro")
    micro = load_config(write_config(tmp_path / "micro.toml", dataset)).model_config()
    assert WeightSource.open(tmp_path / "micro").check_fits(micro, "train.init_from") == []


def test_eval_is_transformers_held_out_loss(cli, saved, dataset):
    model, directory = saved
    code, out, err = cli("eval", "--model", directory, "--data", dataset, "--seq-len", 32, "--batch-size", 4,
                         "--max-batches", 2)
    assert code == 0, err
    total, count = 0.0, 0
    with TokenLoader([(dataset, 1.0)], 32, seed=0, split="val", prefetch=0) as loader:
        for batch in loader.iter_eval_batches(4, split="val", max_batches=2):
            loss, n = _their_loss(model, *inputs_and_targets(batch, IGNORE_INDEX))
            total, count = total + loss, count + n
    result = json.loads(out)
    assert result["tokens"] == count and result["loss"] == pytest.approx(total / count, rel=1e-5)


def _one_line(cli, args, *fragments) -> None:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), (args, err)
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


_NESTED_HYBRID = {"hybrid": ROPE["hybrid"]}
# a window that cannot be: the same line from config.json and from the TOML's [model]
WINDOW_CASES = [
    ("no-window", {"sliding_window": None}, "field 'sliding_window' must be set when layer_types has"),
    ("window-0", {"sliding_window": 0}, "must be a positive integer (the positions a sliding block sees), got 0"),
    ("window-negative", {"sliding_window": -3}, "must be a positive integer (the positions a sliding block sees), "
                                                "got -3"),
    ("window-float", {"sliding_window": 6.5}, "field 'sliding_window' must be a positive integer"),
    ("window-string", {"sliding_window": "6"}, "field 'sliding_window' must be a positive integer"),
]
BAD_CONFIG_JSON = [
    ("type", {"layer_types": ["hybrid", "full_attention", "hybrid", "hybrid"]},
     "layer_types[1] is 'full_attention': a block is 'hybrid' or 'hybrid_sliding'"),
    *WINDOW_CASES,
    ("length", {"layer_types": ["hybrid", "hybrid_sliding"]}, "'layer_types' has 2 entries for num_hidden_layers = 4"),
    ("no-sliding-rope", {"rope_parameters": _NESTED_HYBRID}, "rope_parameters has no 'hybrid_sliding' entry"),
    ("flat-rope", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "rope_parameters has no 'hybrid_sliding' entry"),
    ("linear", {"rope_parameters": {**ROPE, "hybrid_sliding": {"rope_type": "linear", "rope_theta": 1e4,
                                                              "factor": 2.0}}},
     "rope_parameters.hybrid_sliding.rope_type 'linear' is not supported"),
    ("yarn", {"rope_parameters": {**ROPE, "hybrid": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                     "original_max_position_embeddings": 64}}},
     "rope_parameters.hybrid.rope_type 'yarn' is not supported"),
]


@pytest.mark.parametrize(("changed", "says"), [c[1:] for c in BAD_CONFIG_JSON], ids=[c[0] for c in BAD_CONFIG_JSON])
def test_a_bad_sliding_config_json_is_one_line(cli, saved, tmp_path, changed, says):
    _, directory = saved
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = {**json.loads((directory / "config.json").read_text()), **changed}
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    _one_line(cli, ["params", bad], str(bad / "config.json"), says)
    _one_line(cli, ["convert", bad, tmp_path / "ckpt"], says)
    _one_line(cli, ["generate", "--model", bad, "--prompt-ids", "1,2", "--max-new-tokens", "1"], says)
    assert not (tmp_path / "ckpt").exists()


def test_a_stray_top_level_rope_type_is_ignored(cli, saved, tmp_path):
    _, directory = saved
    hub = tmp_path / "hub"
    shutil.copytree(directory, hub)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", **config["rope_parameters"]}
    (hub / "config.json").write_text(json.dumps(config))
    args = ["--prompt-ids", "5,9,11,3,7,2,8,1", "--greedy", "--max-new-tokens", 8, "--output", "ids",
            "--no-stop-at-eos"]
    stray, nested = cli("generate", "--model", hub, *args), cli("generate", "--model", directory, *args)
    assert stray[0] == nested[0] == 0 and stray[1] == nested[1]


BAD_MODEL_SECTION = [
    ("type", {"layer_types": ["hybrid", "sliding", "hybrid_sliding", "hybrid"]},
     "layer_types[1] is 'sliding': a block is 'hybrid' or 'hybrid_sliding'"),
    *WINDOW_CASES,
]


@pytest.mark.parametrize(("changed", "says"), [c[1:] for c in BAD_MODEL_SECTION], ids=[c[0] for c in BAD_MODEL_SECTION])
def test_a_bad_sliding_model_section_is_one_line(cli, dataset, tmp_path, changed, says):
    model = {k: v for k, v in {**MODEL_SECTION, **changed}.items() if v is not None}
    config = write_config(tmp_path / "run.toml", dataset, model=model)
    _one_line(cli, ["train", config, "--run-dir", tmp_path / "run"], "run.toml: [model]: ", says)
    assert not (tmp_path / "run").exists()
