"""Generation with the decode cache: greedy equals recomputing from scratch, sampling is seeded, eos stops."""

import pytest
import torch

from zaya.errors import ZayaError
from zaya.infer.generate import Sampling, decode_loop, distribution, generate, next_token


def _greedy_without_cache(model, prompt, steps):
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1]:]


def test_greedy_generation_equals_full_recomputation(make_model):
    model = make_model("micro")
    prompt = torch.randint(0, 512, (3, 5), generator=torch.Generator().manual_seed(0))
    assert generate(model, prompt, 12).tolist() == _greedy_without_cache(model, prompt, 12).tolist()


def test_sampling_is_reproducible_with_a_seed_and_varies_without(make_model):
    model = make_model("micro")
    prompt = torch.tensor([[1, 2, 3]])
    sampling = Sampling(greedy=False, temperature=1.5, seed=123)
    first = generate(model, prompt, 20, sampling)
    assert torch.equal(first, generate(model, prompt, 20, sampling))
    assert not torch.equal(first, generate(model, prompt, 20, Sampling(greedy=False, temperature=1.5, seed=124)))


def test_tiny_top_p_is_greedy(make_model):
    model = make_model("micro")
    prompt = torch.tensor([[7, 8]])
    nucleus = Sampling(greedy=False, top_p=1e-6, seed=0)
    assert torch.equal(generate(model, prompt, 10, nucleus), generate(model, prompt, 10))


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    seen = {int(next_token(logits, Sampling(greedy=False, top_p=0.75), generator)) for _ in range(300)}
    assert seen == {0, 1}


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "penalty"), [
    (0.7, 5, 0.9, 1.3), (1.3, 0, 0.6, 0.8), (1.0, 12, 1.0, 1.0), (0.5, 1, 1.0, 2.0),
])
def test_the_sampled_distribution_is_transformers(temperature, top_k, top_p, penalty):
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3
    history = torch.tensor([[1, 5, 7, 5], [3, 3, 39, 0], [10, 11, 12, 13]])
    steps = [RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)]
    steps += [TopKLogitsWarper(top_k)] if top_k else []
    steps += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    expected = torch.softmax(LogitsProcessorList(steps)(history, logits.clone()), dim=-1)
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, history, True)
    sampling = Sampling(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    torch.testing.assert_close(distribution(logits, sampling, seen), expected)


def test_the_repetition_penalty_steers_greedy_decoding_away_from_what_it_saw(make_model):
    model = make_model("micro")
    prompt = torch.tensor([[5, 6, 7]])
    free = generate(model, prompt, 12)
    penalised = generate(model, prompt, 12, Sampling(repetition_penalty=50.0))
    assert len(set(penalised[0].tolist())) == 12 and not set(penalised[0].tolist()) & {5, 6, 7}
    assert len(set(free[0].tolist())) < 12  # a perturbed micro model repeats itself


def test_generation_stops_once_every_row_produced_eos(make_model):
    model = make_model("micro")
    prompt = torch.tensor([[5, 6, 7]])
    free = generate(model, prompt, 10)
    eos = int(free[0, 3])
    stopped = generate(model, prompt, 10, eos_token_id=eos)
    assert stopped.shape[1] == int((free[0] == eos).nonzero()[0]) + 1
    assert int(stopped[0, -1]) == eos


def test_bad_prompts_are_refused(make_model):
    model = make_model("micro")
    with pytest.raises(ZayaError, match="outside the model's vocabulary"):
        generate(model, torch.tensor([[1, 512]]), 3)
    with pytest.raises(ZayaError, match="empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ZayaError, match="temperature"):
        Sampling(greedy=False, temperature=0.0)
    with pytest.raises(ZayaError, match="top-k"):
        Sampling(greedy=False, top_k=-1)
    with pytest.raises(ZayaError, match="repetition-penalty"):
        Sampling(repetition_penalty=0.0)


def test_generation_stops_at_any_of_several_ids_and_a_finished_row_repeats_its_own():
    script = [[5, 9, 3, 3], [5, 5, 7, 2]]  # row 0 ends at 9, row 1 at 7, one step later
    logits = [torch.nn.functional.one_hot(torch.tensor([row[i] for row in script]), 16).float() for i in range(4)]
    steps = iter(logits[1:])
    out = decode_loop(logits[0], lambda token: next(steps), 10, Sampling(), None, eos_token_id=(9, 7))
    assert out.tolist() == [[5, 9, 9], [5, 5, 7]]
    steps = iter(logits[1:])
    assert decode_loop(logits[0], lambda token: next(steps), 4, Sampling(), None, eos_token_id=[7]).tolist() == [
        [5, 9, 3, 3], [5, 5, 7, 7]]
    for bad in ([], [-1], ["9"], 2.0):
        with pytest.raises(ZayaError, match="eos_token_id must be a token id"):
            decode_loop(logits[0], lambda token: logits[1], 3, Sampling(), None, eos_token_id=bad)
