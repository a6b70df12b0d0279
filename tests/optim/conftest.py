"""Optimizer tests run on small matrices, where two OpenMP threads mostly wait on each other (and on anything
else the machine runs): one thread keeps them fast and their timing steady."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
