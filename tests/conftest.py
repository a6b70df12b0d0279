"""Shared fixtures: small models with every parameter moved off its initial value."""

from __future__ import annotations

import warnings

import pytest

import zaya
from modeling import perturb
from ranks import close_pool
from runs import build_code_dataset

warnings.filterwarnings("ignore", message=".*TypedStorage.*")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small real dataset: the Python sources of two standard-library packages, with a 400-token BPE."""
    return build_code_dataset(tmp_path_factory.mktemp("data"), ["json", "email"], val_fraction=0.2)


@pytest.fixture
def make_model():
    """make_model(preset_or_config, seed=0, **overrides) -> a perturbed fp32 model in eval mode."""

    def factory(preset_or_config="micro", seed: int = 0, **overrides):
        if isinstance(preset_or_config, str):
            config = zaya.get_preset(preset_or_config, **{"temp_init": 1.0, **overrides})
        else:
            config = preset_or_config.replace(**overrides) if overrides else preset_or_config
        return perturb(zaya.build_model(config, seed=seed), seed=seed).eval()

    return factory


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the `zaya` command in-process; returns (exit code, stdout, stderr)."""
    from zaya.cli import main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def cli(capsys):
    return lambda *args: run_cli(list(args), capsys)


def pytest_sessionfinish(session, exitstatus):
    close_pool()  # the ranks of tests/ranks.py, started once per session
