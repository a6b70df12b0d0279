"""Every number given to generation and held-out evaluation is bounded and refused in one line naming it, the
sampling is numerically safe for every accepted value, sequences fit the model's positions, and text is made
only of ids its tokenizer can decode."""

import itertools
import math

import pytest
import torch

import zaya
from modeling import perturb
from zaya.data.tokenizer import train_bpe
from zaya.errors import ZayaError
from zaya.infer.generate import Sampling, decode_loop, distribution, generate, next_token
from zaya.infer.static import CompiledDecoder
from zaya.infer.tree import generate_sharded
from zaya.infer.vocab import allowed_ids, tokenizer_ids

POSITIONS = 64  # the test model's max_position_embeddings
HIGH = 300  # the test model prefers ids from here on, beyond its tokenizer's


def _one_line(result, *fragments):
    code, _, err = result
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def model():
    """A micro model of 64 positions whose embedding rows from HIGH on are scaled up, so that it prefers those
    ids (the tied head makes their logits large)."""
    model = perturb(zaya.build_model(zaya.get_preset("micro", temp_init=1.0, max_position_embeddings=POSITIONS),
                                     seed=0)).eval()
    with torch.no_grad():
        model.embed.weight[HIGH:] *= 8
    return model


@pytest.fixture(scope="module")
def tok():
    tokenizer = train_bpe(["hello there, how are you?\n"] * 20, 300,
                          extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    assert tokenizer_ids(tokenizer)[-1] < HIGH
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(model, tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("bounds") / "hf"
    zaya.export_hf(model, path)
    tok.save(str(path / "tokenizer.json"))
    return path


# ---- sampling parameters ------------------------------------------------------------------------------------

BAD_SAMPLING = [
    *(("temperature", v, "[0.001, 100]") for v in (1e-40, math.inf, math.nan, 0.0, -1.0, 1e3)),
    *(("repetition_penalty", v, "[0.01, 100]") for v in (1e-300, math.inf, math.nan, 0.0, -2.0, 1e300)),
    *(("top_p", v, "(0, 1]") for v in (0.0, -0.5, 1.5, math.nan, math.inf)),
    *(("top_k", v, "0..16,777,216") for v in (-1, 2**70, 1.5, True)),
    *(("seed", v, "0..2**63-1") for v in (-1, 2**64, 10**30, 1.0)),
]


@pytest.mark.parametrize(("name", "value", "bound"), BAD_SAMPLING)
def test_sampling_parameters_out_of_range_are_refused_by_the_api(name, value, bound):
    with pytest.raises(ZayaError, match=r"^" + name.replace("_", "-")) as refused:
        Sampling(greedy=False, **{name: value})
    assert bound in str(refused.value) and "\n" not in str(refused.value)


def test_sampling_flags_out_of_range_are_one_line_before_the_model_loads(cli, tmp_path):
    base = ["generate", "--model", tmp_path / "no-such-model", "--prompt-ids", "5,6"]
    for name, value, bound in BAD_SAMPLING:
        if isinstance(value, (bool, float)) and name in ("top_k", "seed"):
            continue  # click's int type refuses those itself
        flag = "--" + name.replace("_", "-")
        _one_line(cli(*base, flag, str(value)), flag, bound)
    for ids in (str(2**70), "3,-5", "16777216", "1," + "9" * 5000):
        _one_line(cli("generate", "--model", tmp_path / "m", "--prompt-ids", ids), "--prompt-ids")
    _one_line(cli(*base, "--max-new-tokens", str(10**12), "--compile"), "--max-new-tokens", "67,108,864")


EXTREME_LOGITS = torch.tensor([
    [3.0e38, -3.0e38, 1.0, 0.0, -1.0, 2.0],
    [-3.0e38, -3.0e38, -3.0e38, -3.0e38, -3.0e38, -2.9e38],
    [-math.inf, 5.0, -math.inf, 4.0, 1e-30, -math.inf],
    [1e4, 1e4, 1e4, -1e4, 0.0, 1e4],
])


def test_sampling_is_finite_for_every_accepted_value_and_any_finite_logits():
    seen = torch.ones_like(EXTREME_LOGITS, dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    for temperature, penalty, top_p in itertools.product([1e-3, 1.0, 100.0], [1e-2, 1.0, 100.0],
                                                         [1e-300, 0.5, 1.0]):
        sampling = Sampling(greedy=False, temperature=temperature, top_p=top_p, repetition_penalty=penalty, top_k=3)
        for dtype in (torch.float32, torch.bfloat16):
            logits = EXTREME_LOGITS.to(dtype)
            probs = distribution(logits, sampling, seen)
            assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
            picked = next_token(logits, sampling, generator, seen)
            assert bool((probs.gather(1, picked[:, None]) > 0).all())  # never a masked (-inf) token
            assert int(picked[2]) in (1, 3, 4)


def test_a_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    probs = distribution(logits, Sampling(greedy=False, top_p=1e-300))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_logits_a_model_cannot_give_are_one_line_not_nan_into_multinomial():
    bad = [torch.tensor([[0.0, math.nan, 1.0]]), torch.tensor([[0.0, math.inf, 1.0]]),
           torch.full((1, 3), -math.inf)]
    for logits in bad:
        for sampling in (Sampling(), Sampling(greedy=False, seed=0)):
            picked = next_token(logits, sampling, None)  # a row made uniform: never NaN into multinomial
            assert 0 <= int(picked[0]) < 3
            steps = iter([logits, torch.zeros(1, 3)])  # broken at the first step only: still refused at the end
            with pytest.raises(ZayaError, match="logits hold NaN or infinity"):
                decode_loop(next(steps), lambda _token, steps=steps: next(steps), 2, sampling, None)


# ---- lengths --------------------------------------------------------------------------------------------------

def test_sequences_beyond_the_model_positions_are_refused_before_any_allocation(model, monkeypatch):
    prompt = torch.tensor([[5, 6, 7]])

    def no_cache(*args, **kwargs):
        raise AssertionError("a cache was allocated")

    monkeypatch.setattr(type(model), "new_cache", no_cache)
    for decoder in (None, CompiledDecoder(model)):
        for new, match in ((POSITIONS - 2, r"make 65, more than the model's max_position_embeddings \(64\)"),
                           (10**12, r"max-new-tokens must be an integer in 0\.\.67,108,864")):
            with pytest.raises(ZayaError, match=match):
                generate(model, prompt, new, decoder=decoder)
    with pytest.raises(ZayaError, match="the prompt has 65 tokens, more than"):
        generate(model, torch.ones(1, POSITIONS + 1, dtype=torch.long), 0)
    # refused before the sharded decoder asks for a process group
    with pytest.raises(ZayaError, match="max_position_embeddings"):
        generate_sharded(model, prompt, POSITIONS - 2)
    for new in (-1, 2.0, True):
        with pytest.raises(ZayaError, match=r"max-new-tokens must be an integer in 0\.\.67,108,864"):
            generate(model, prompt, new)
    with pytest.raises(ZayaError, match="must be integers"):
        generate(model, prompt.float(), 1)


def test_a_sequence_that_just_fits_is_generated(model):
    prompt = torch.arange(POSITIONS - 2)[None] % 200
    assert generate(model, prompt, 2).shape == (1, 2)


def test_length_flags_are_one_line_in_plain_compiled_and_sharded_generation(cli, model_dir):
    prompt = ",".join(["5"] * (POSITIONS - 1))
    base = ["generate", "--model", model_dir, "--output", "ids", "--prompt-ids"]
    for mode in ([], ["--compile"], ["--shard-kv"]):
        _one_line(cli(*base, "5,6,7", "--max-new-tokens", "62", *mode), "--max-new-tokens 62 make 65",
                  "max_position_embeddings (64)", "at most 61 new tokens")
        _one_line(cli(*base, prompt + ",5,5", *mode), "the prompt has 65 tokens")
    code, out, err = cli(*base, prompt, "--max-new-tokens", "1", "--no-stop-at-eos")
    assert code == 0 and len(out.strip().split(",")) == 1, err


def test_eval_sizes_are_bounded_and_seq_len_by_the_model_positions(cli, model_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    data = ["eval", "--model", missing, "--data", tmp_path / "no-such-data"]
    _one_line(cli(*data, "--batch-size", str(10**9)), "--batch-size must be at most 65,536")
    _one_line(cli(*data, "--seq-len", str(10**12)), "--seq-len must be an integer in 1..1,048,576")
    _one_line(cli(*data, "--max-batches", str(10**12)), "--max-batches must be an integer in 1..2,147,483,648")
    _one_line(cli(*data, "--batch-size", "4096", "--seq-len", "4096"), "16,777,216 tokens a batch")
    tasks = ["eval", "--model", missing, "--tasks", "x"]
    _one_line(cli(*tasks, "--limit", str(10**12)), "--limit must be at most 16,777,216")
    _one_line(cli(*tasks, "--num-fewshot", str(10**6)), "--num-fewshot must be at most 1,024")
    # the model loads, and its 64 positions refuse 65 before any data is read
    _one_line(cli("eval", "--model", model_dir, "--data", tmp_path / "no-such-data", "--seq-len", "65"),
              "--seq-len 65 is more than the model's max_position_embeddings (64)")


# ---- the tokenizer --------------------------------------------------------------------------------------------

def test_text_is_made_only_of_ids_the_tokenizer_can_decode(cli, model, model_dir, tok):
    prompt = torch.tensor([tok.encode("hello").ids])
    free = generate(model, prompt, 6)[0].tolist()
    assert any(i >= HIGH for i in free)  # what the model prefers, and the tokenizer would print as nothing
    masked = generate(model, prompt, 6, allowed=allowed_ids(tokenizer_ids(tok), 512))[0].tolist()
    assert all(i in set(tokenizer_ids(tok)) for i in masked)
    code, out, err = cli("generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", "6",
                         "--no-stop-at-eos")
    assert code == 0 and out == "hello" + tok.decode(masked) + "\n", err
    # as ids, the model's own choice
    code, out, _ = cli("generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", "6",
                       "--no-stop-at-eos", "--output", "ids")
    assert code == 0 and out.strip() == ",".join(map(str, free))
    # the API's mask is checked
    for bad in (torch.ones(511, dtype=torch.bool), torch.ones(512), torch.zeros(512, dtype=torch.bool)):
        with pytest.raises(ZayaError, match=r"allowed ids|no token id is allowed"):
            generate(model, prompt, 1, allowed=bad)


def test_a_tokenizer_that_does_not_fit_the_model_is_one_line(cli, model_dir, tok, tmp_path):
    big = train_bpe(["hello there, how are you?\n"] * 20, 300)
    big.add_tokens([f"<extra{i}>" for i in range(300)])  # ids beyond the model's 512
    big.save(str(tmp_path / "big.json"))
    _one_line(cli("generate", "--model", model_dir, "--tokenizer", tmp_path / "big.json", "--prompt", "hello"),
              "big.json: the tokenizer has ids up to", "beyond the model's vocabulary of 512")
    # smaller than the tokenizer the model carries (the one its data was built with)
    small = train_bpe(["hello there, how are you?\n"] * 20, 300)
    small.save(str(tmp_path / "small.json"))
    assert tokenizer_ids(small)[-1] < tokenizer_ids(tok)[-1]
    _one_line(cli("generate", "--model", model_dir, "--tokenizer", tmp_path / "small.json", "--prompt", "hello"),
              "small.json: the tokenizer's ids end at", f"({model_dir / 'tokenizer.json'})")
    # as large as the model's own: taken
    tok.save(str(tmp_path / "same.json"))
    code, _, err = cli("generate", "--model", model_dir, "--tokenizer", tmp_path / "same.json", "--prompt", "hello",
                       "--max-new-tokens", "2")
    assert code == 0, err


def test_a_chat_template_that_fails_on_the_prompt_is_one_line(cli, model_dir):
    template = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
                "{{ raise_exception('no booms here\n' + 'x' * 100000) }}{% endif %}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (model_dir / "chat_template.jinja").write_text(template)
    try:
        code, _, err = cli("generate", "--model", model_dir, "--chat", "--prompt", "boom")
        _one_line((code, "", err), "chat template fails on this prompt (no booms here)")
        assert len(err) < 1000
    finally:
        (model_dir / "chat_template.jinja").unlink()
