"""The trainer tests' dataset and config writer, shared with the supervisor tests."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).parent.parent / "train" / "conftest.py")
_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_train)

dataset = _train.dataset
write_config = _train.write_config
