"""The run-directory contract and typed config loading, including every config error path."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest
import yaml

from lmforge.config import ConfigError, dump_yaml, load_config, to_dict
from lmforge.track.run import RunDir, RunExistsError


@dataclass
class Train:
    lr: float = 1e-3
    steps: int = 10
    compile: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class Model:
    init: Optional[str] = None
    out: Path = Path("model")
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class Cfg:
    name: str = "run"
    seed: int = 0
    train: Train = field(default_factory=Train)
    model: Model = field(default_factory=Model)


# --- run directory -----------------------------------------------------------------------------

def test_run_dir_metrics_config_record(tmp_path):
    run = RunDir(tmp_path / "r")
    run.write_config(Cfg())
    run.log_metrics({"step": 1, "loss": 3.0})
    run.log_metrics({"step": 2, "loss": 2.5})
    run.finish(val_loss=2.4)
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["train"]["lr"] == 1e-3
    record = json.loads((tmp_path / "r" / "record.json").read_text())
    assert record["status"] == "finished" and record["results"] == {"val_loss": 2.4}
    assert {"commit", "dirty"} <= record["git"].keys() and record["packages"]["torch"]
    assert record["hardware"]["cpu_count"] >= 1 and record["peak_memory"]["cpu_max_rss_bytes"] > 0
    assert record["started_at"] and record["finished_at"] and record["wall_time_s"] >= 0


def test_run_dir_refuses_finished_run_unless_asked(tmp_path):
    RunDir(tmp_path).finish()
    with pytest.raises(RunExistsError, match="--overwrite"):
        RunDir(tmp_path)
    resumed = RunDir(tmp_path, resume=True)
    assert resumed.read_record()["status"] == "running"
    resumed.log_metrics({"step": 1})
    resumed.finish()
    RunDir(tmp_path, overwrite=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_run_dir_reopens_unfinished_and_marks_failures(tmp_path):
    with pytest.raises(RuntimeError), RunDir(tmp_path) as run:
        run.log_metrics({"step": 1})
        raise RuntimeError("boom")
    assert json.loads((tmp_path / "record.json").read_text())["status"] == "failed"
    RunDir(tmp_path).log_metrics({"step": 2})  # a crashed run may be reopened
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


# --- config ------------------------------------------------------------------------------------

def test_defaults_yaml_and_overrides(tmp_path):
    assert load_config(Cfg) == Cfg()
    path = tmp_path / "c.yaml"
    path.write_text("name: exp\ntrain:\n  steps: 5\n  lr: 1\nmodel:\n  device: cpu\n")
    cfg = load_config(Cfg, path, ["train.lr=3e-4", "model.init=some/path", "train.compile=true",
                                  "train.betas=[0.8, 0.99]", "seed=7", "name=123", "model.out=x/y"])
    assert cfg.name == "123" and cfg.seed == 7 and cfg.model.device == "cpu"
    assert cfg.train == Train(lr=3e-4, steps=5, compile=True, betas=[0.8, 0.99])
    assert cfg.model.init == "some/path" and cfg.model.out == Path("x/y")
    assert load_config(Cfg, None, ["model.init=null"]).model.init is None


def test_dump_roundtrip(tmp_path):
    cfg = load_config(Cfg, None, ["train.lr=0.5", "model.out=a/b"])
    assert to_dict(cfg)["model"]["out"] == "a/b"
    (tmp_path / "r.yaml").write_text(dump_yaml(cfg))
    assert load_config(Cfg, tmp_path / "r.yaml") == cfg


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "unknown key 'lrr' in 'train'; valid keys: betas, compile, lr, steps"),
    (["nope=1"], "unknown key 'nope'"),
    (["train.steps=1.5"], "train.steps expects int"),
    (["train.lr=fast"], "train.lr expects float"),
    (["train.compile=maybe"], "train.compile expects bool"),
    (["train.betas=[1, x]"], r"train.betas\[1\] expects float"),
    (["model.device=tpu"], "model.device must be one of"),
    (["train=1"], "train is a section"),
    (["seed.x=1"], "not a section"),
    (["seed"], "must look like key=value"),
])
def test_override_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, None, overrides)


@pytest.mark.parametrize("text, message", [
    ("train:\n  lr: [1]\n", "train.lr expects float"),
    ("train:\n  step: 3\n", "unknown key 'step' in 'train'"),
    ("train: 3\n", "train is a section"),
    ("- a\n", "top level must be a mapping"),
    ("train: [unclosed\n", "not valid YAML"),
    ("seed: true\n", "seed expects int"),
])
def test_file_errors_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(Cfg, path)
    assert str(path) in str(e.value)


def test_missing_file_and_required_field(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(Cfg, tmp_path / "missing.yaml")

    @dataclass
    class Needs:
        data: str

    with pytest.raises(ConfigError, match="incomplete"):
        load_config(Needs)
