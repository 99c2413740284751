"""TrainerConfig.cluster_key: a bad key file is a clear ConfigError before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from chaos.errors import ConfigError
from chaos.security import ClusterKey
from chaos.trainer.trainer import Trainer, TrainerConfig


def test_a_missing_key_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TrainerConfig(cluster_key=str(tmp_path / "nope.key"))


def test_a_key_file_readable_by_others_is_a_config_error(tmp_path: Path) -> None:
    path = ClusterKey.generate().write(tmp_path / "cluster.key")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        TrainerConfig(cluster_key=str(path))


def test_a_file_that_is_not_a_key_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "other.txt"
    path.write_text("hello\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="not a chaos cluster key"):
        TrainerConfig(cluster_key=str(path))


def test_a_good_key_file_is_accepted(tmp_path: Path) -> None:
    path = ClusterKey.generate().write(tmp_path / "cluster.key")
    assert TrainerConfig(cluster_key=str(path)).cluster_key == str(path)
    assert TrainerConfig().cluster_key is None


def test_the_trainer_refuses_a_bad_key_before_starting_a_daemon(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cluster key"):
        Trainer(model, opt, cluster_key=str(tmp_path / "missing.key"),
                daemon_dir=str(tmp_path / "run"))  # fmt: skip
    assert not (tmp_path / "run").exists()  # no embedded daemon was started
