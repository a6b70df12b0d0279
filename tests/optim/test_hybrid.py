"""The Muon / AdamW split, the hybrid optimizer against torch's AdamW and our Muon, its state dict, the
printable table and the config checks."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import zaya
from zaya.errors import ZayaError
from zaya.optim.config import OptimConfig
from zaya.optim.hybrid import MuonAdamW, adamw_defaults, build_optimizer, describe_param_groups, split_parameters
from zaya.optim.muon import Muon


def meta_model(preset: str) -> zaya.Zaya:
    with torch.device("meta"):
        return zaya.Zaya(zaya.get_preset(preset))


def expected_muon_names(layers: int) -> set[str]:
    """The spec's list: attention projections, router matrices and the two stacked expert tensors."""
    names = set()
    for layer in range(layers):
        names |= {f"blocks.{layer}.attn.{p}_proj.weight" for p in ("q", "k", "v_cur", "v_del", "o")}
        names |= {f"blocks.{layer}.moe.router.{p}.weight" for p in ("down_proj", "fc1", "fc2", "out_proj")}
        names |= {f"blocks.{layer}.moe.experts.{p}" for p in ("gate_up_proj", "down_proj")}
    return names


def test_zaya1_base_split():
    model = meta_model("zaya1-base")
    config = model.config
    specs = split_parameters(model)
    muon = {name for spec in specs if spec.algorithm == "muon" for name in spec.names}
    adamw = {name for spec in specs if spec.algorithm == "adamw" for name in spec.names}
    assert muon == expected_muon_names(config.num_hidden_layers)
    all_names = {name for name, _ in model.named_parameters()}
    assert adamw == all_names - muon
    assert sum(spec.numel for spec in specs) == sum(p.numel() for p in model.parameters())
    # every expert is its own matrix: 9 matrices per block plus 2 x 16 experts
    layers, experts = config.num_hidden_layers, config.num_experts
    assert sum(spec.matrices for spec in specs if spec.algorithm == "muon") == layers * (9 + 2 * experts)
    decayed = {spec.name for spec in specs if spec.decay}
    assert decayed == {"muon/attention", "muon/router", "muon/experts", "adamw/embedding", "adamw/convolutions"}
    by_group = {spec.name: set(spec.names) for spec in specs}
    assert by_group["adamw/embedding"] == {"embed.weight"}
    assert by_group["adamw/eda-gammas"] == {f"blocks.{i}.moe.router.router_states_scale" for i in range(1, layers)}
    assert by_group["adamw/temperatures"] == {f"blocks.{i}.attn.temp" for i in range(layers)}


def test_build_optimizer_covers_every_parameter_once():
    model = meta_model("zaya1-base")
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3, adamw_lr=1e-3, weight_decay=0.05))
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    vectors = {"adamw/norms", "adamw/biases", "adamw/residual-scaling", "adamw/eda-gammas", "adamw/temperatures"}
    rates = {"muon": 3e-3, "adamw": 1e-3, "vector": 3e-5}  # the vectors at vector_lr_ratio (0.03) of AdamW's
    for group in optimizer.param_groups:
        kind = "vector" if group["name"] in vectors else group["algorithm"]
        assert group["initial_lr"] == group["lr"] == pytest.approx(rates[kind]), group["name"]
        assert group["name"].startswith(group["algorithm"] + "/")
        assert group["weight_decay"] in (0.0, 0.05)
    assert {group["name"] for group in optimizer.param_groups} >= vectors | {"adamw/embedding", "muon/experts"}
    whole = build_optimizer(model, OptimConfig(lr=3e-3, vector_lr_ratio=1.0))  # the rate of every AdamW group
    assert {group["lr"] for group in whole.param_groups} == {3e-3}


def test_describe_param_groups_adds_up():
    model = meta_model("zaya1-base")
    table = describe_param_groups(model)
    for spec in split_parameters(model):
        assert spec.name in table
    total = re.search(r"^total\s+([\d,]+)\s+([\d,]+)$", table, re.MULTILINE)
    assert total is not None
    assert int(total.group(1).replace(",", "")) == len(list(model.parameters()))
    assert int(total.group(2).replace(",", "")) == sum(p.numel() for p in model.parameters())
    assert "blocks.*.moe.experts.gate_up_proj" in table


def fill_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def test_adamw_groups_match_torch_adamw(make_model):
    model = make_model("micro")
    twin = copy.deepcopy(model)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    twin_params = dict(twin.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    adamw_groups = [g for g in optimizer.param_groups if g["algorithm"] == "adamw"]
    reference = torch.optim.AdamW(
        [
            {"params": [twin_params[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"],
             "lr": g["lr"]}
            for g in adamw_groups
        ],
        betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    for step in range(3):
        fill_grads(model, step)
        fill_grads(twin, step)
        optimizer.step()
        reference.step()
    for group in adamw_groups:
        for param in group["params"]:
            assert torch.equal(param.detach(), twin_params[names[id(param)]].detach())
    assert any(g["weight_decay"] > 0 for g in adamw_groups) and any(g["weight_decay"] == 0 for g in adamw_groups)
    assert sorted({round(g["lr"], 12) for g in adamw_groups}) == [3e-4, 1e-2]  # the vectors at 0.03 x


def test_muon_groups_match_muon(make_model):
    model = make_model("micro")
    twin = copy.deepcopy(model)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, adjust_lr_fn="original"))
    names = {id(p): n for n, p in model.named_parameters()}
    twin_params = dict(twin.named_parameters())
    muon_params = [p for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    reference = Muon([twin_params[names[id(p)]] for p in muon_params], lr=1e-2, weight_decay=0.1,
                     adjust_lr_fn="original")  # fmt: skip
    for step in range(2):
        fill_grads(model, step)
        fill_grads(twin, step)
        optimizer.step()
        reference.step()
    for param in muon_params:
        assert torch.equal(param.detach(), twin_params[names[id(param)]].detach())


def test_training_lowers_the_loss(make_model):
    model = make_model("micro").train()
    ids = torch.randint(0, model.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))

    def loss():
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    losses = []
    for _ in range(8):
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    assert losses[-1] < losses[0] - 0.5


def test_state_dict_round_trip_is_exact(make_model):
    model = make_model("micro")
    optimizer = build_optimizer(model)
    for step in range(2):
        fill_grads(model, step)
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    # tensors aside, the state dict is JSON: what the checkpoint's train state can hold
    skeleton = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: None, state)
    assert json.loads(json.dumps(skeleton))["param_groups"][0]["name"] == "muon/attention"
    twin = copy.deepcopy(model)
    resumed = build_optimizer(twin, OptimConfig(lr=0.5))
    resumed.load_state_dict(state)
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in optimizer.param_groups]
    fill_grads(model, 7)
    fill_grads(twin, 7)
    optimizer.step()
    resumed.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert {k for s in state["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}


def test_groups_need_a_known_algorithm():
    with pytest.raises(ZayaError, match="'algorithm'"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "algorithm": "sgd"}])
    with pytest.raises(ZayaError, match="'betas'"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "algorithm": "adamw", "betas": (0.9,)}])
    group = MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "algorithm": "adamw"}]).param_groups[0]
    assert {k: group[k] for k in adamw_defaults()} == adamw_defaults()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("weight_decay", -0.1),
        ("adamw_lr", -1.0),
        ("vector_lr_ratio", 0.0),
        ("vector_lr_ratio", float("nan")),
        ("adamw_betas", (0.9, 1.0)),
        ("adamw_eps", 0),
        ("decay_vectors", "yes"),
        ("momentum", 1.5),
        ("nesterov", 1),
        ("ns_steps", 100),
        ("ns_coefficients", (1.0, 2.0)),
        ("ns_eps", -1e-7),
        ("ns_dtype", "float16"),
        ("ns_backend", "cuda"),
        ("adjust_lr_fn", None),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ZayaError, match=f"field '{field}'"):
        OptimConfig(**{field: value})


def test_config_from_dict():
    config = OptimConfig.from_dict({"lr": 2e-3, "adamw_betas": [0.9, 0.99], "ns_dtype": "float32"}, source="run.json")
    assert config.adamw_betas == (0.9, 0.99) and config.adamw_rate == 2e-3
    assert OptimConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ZayaError, match=r"run\.json: unknown field 'betas'"):
        OptimConfig.from_dict({"betas": [0.9, 0.95]}, source="run.json")
    with pytest.raises(ZayaError, match=r"run\.json: field 'ns_steps'"):
        OptimConfig.from_dict({"ns_steps": 2.5}, source="run.json")
