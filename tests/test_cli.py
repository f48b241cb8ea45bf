"""The command-line entry points, end to end on a tiny model."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import elastic_jax as ej
from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(*args, cwd=ROOT):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV,
                        cwd=cwd)


def test_demo_runs_and_checks_itself(tmp_path):
  proc = _run("-m", "elastic_jax.demo", "--out", str(tmp_path / "demo"), "--tokens", "20")
  assert proc.returncode == 0, proc.stderr
  assert "HF dir vs converted: identical" in proc.stdout
  assert "HF -> ours -> HF tensors: identical" in proc.stdout


def test_eval_perplexity_matches_logits(tmp_path):
  with open(os.path.join(ROOT, "configs", "tiny_llama3.json")) as f:
    raw = json.load(f)
  cfg = config_from_hf_dict(raw)
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(3), "float32"), raw)
  ej.save_pretrained(model, tmp_path / "m")
  ids = [5, 17, 300, 2, 2, 99, 511, 0]
  (tmp_path / "ids.json").write_text(json.dumps(ids))
  proc = _run("eval.py", "ppl", "--model", str(tmp_path / "m"), "--ids",
              str(tmp_path / "ids.json"), "--dtype", "float32")
  assert proc.returncode == 0, proc.stderr
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  logits = np.asarray(model.logits(ids))[0, :-1].astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
  assert result["tokens"] == len(ids)
  assert result["mean_nll"] == pytest.approx(nll.mean(), rel=1e-5)


def test_eval_bad_input_exits_2(tmp_path):
  (tmp_path / "ids.json").write_text("[1, 2,")
  proc = _run("eval.py", "ppl", "--model", str(tmp_path), "--ids", str(tmp_path / "ids.json"))
  assert proc.returncode == 2 and proc.stderr.startswith("error:")


def test_train_bad_arguments_exit_2(tmp_path):
  # The smoke config: the default one (the CPU reproduction) lays its 4 rows out for 1 device.
  tiny = ("--config", "configs/tiny.yaml")
  proc = _run("train.py", *tiny, "train.steps=0", f"run_dir={tmp_path / 'run'}")
  assert proc.returncode == 2 and proc.stderr.startswith("error:")
  assert "train" in proc.stderr and "steps" in proc.stderr
  proc = _run("train.py", *tiny, f"model.path={tmp_path / 'missing.json'}")
  assert proc.returncode == 2 and "missing.json" in proc.stderr
  assert not (tmp_path / "run").exists()


def _parsers():
  """Every command's parser: (name, parser), subcommands one by one."""
  import argparse
  from elastic_jax.convert.__main__ import build_parser as convert_parser
  from elastic_jax.eval.cli import build_parser as eval_parser
  from elastic_jax.generation.server import build_parser as serve_parser
  from elastic_jax.train.cli import build_parser as train_parser
  out = [("train", train_parser()), ("convert", convert_parser()), ("serve", serve_parser())]
  p = eval_parser()
  out.append(("eval", p))
  for action in p._actions:
    if isinstance(action, argparse._SubParsersAction):
      out += [(f"eval {name}", sub) for name, sub in action.choices.items()]
  return out


def test_every_option_has_help_and_dtype_defaults_to_auto():
  for name, parser in _parsers():
    for action in parser._actions:
      assert action.help, (name, action.option_strings or action.dest)
      if "--dtype" in action.option_strings:
        assert action.default == "auto", name
        assert "auto" in action.help and "own dtype" in action.help, name


@pytest.mark.parametrize("module,default,console", [
    ("elastic_jax.train.cli", "train.py", "elastic-jax-train"),
    ("elastic_jax.eval.cli", "eval.py", "elastic-jax-eval"),
    ("elastic_jax.convert.__main__", "python -m elastic_jax.convert", "elastic-jax-convert"),
    ("elastic_jax.generation.server", "python -m elastic_jax.generation.server",
     "elastic-jax-serve")])
def test_usage_names_the_command_invoked(module, default, console, monkeypatch):
  import importlib
  build = importlib.import_module(module).build_parser
  monkeypatch.setattr(sys, "argv", [f"/somewhere/bin/{console}", "--help"])
  helped = build().format_help()
  assert helped.startswith(f"usage: {console} ") and f"\n  {default} " not in helped
  monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "x.py")])
  assert build().format_usage().startswith(f"usage: {default} ")


def test_train_print_config_is_yaml_that_config_reads_back(tmp_path, monkeypatch, capsys):
  """From a folder outside the repository: `--config configs/tiny.yaml` (the form the help
  shows) is the shipped file; the printed config is YAML that --config reads back equal."""
  import yaml
  from elastic_jax.train.cli import main
  from elastic_jax.train.run_config import load_run_config
  monkeypatch.chdir(tmp_path)
  assert main(["--config", "configs/tiny.yaml", "train.steps=7", "--print-config"]) == 0
  first = capsys.readouterr().out
  assert isinstance(yaml.safe_load(first), dict) and "\n  steps: 7\n" in first
  assert "# the frozen backbone\nmodel:\n" in first
  (tmp_path / "printed.yaml").write_text(first)
  assert main(["--config", "printed.yaml", "--print-config"]) == 0
  assert capsys.readouterr().out == first
  shipped = load_run_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["train.steps=7"])
  assert load_run_config(tmp_path / "printed.yaml") == shipped
  with pytest.raises(ej.ElasticJaxError, match="configs/nope.yaml: no such config file"):
    main(["--config", "configs/nope.yaml", "--print-config"])


@pytest.mark.parametrize("argv", [
    ["ruler", "--model", "m", "--lengths", "512,1024", "--batch-size", "2", "--chat", "off"],
    ["mixture", "--samples", "2", "--attention", "full,sparse"],
    ["longbench", "--model", "m", "--data", "lb", "--e", "--max-length", "300"],
    ["ppl", "--model", "m", "--ids", "ids.json", "--max-tokens", "8"]])
def test_eval_print_config_is_yaml_that_config_reads_back(argv, tmp_path, monkeypatch, capsys):
  import yaml
  from elastic_jax.eval.cli import main
  monkeypatch.chdir(tmp_path)
  assert main([*argv, "--print-config"]) == 0
  first = capsys.readouterr().out
  settings = yaml.safe_load(first)
  assert settings["command"] == argv[0] and settings["dtype"] == "auto"
  (tmp_path / "settings.yaml").write_text(first)
  assert main([argv[0], "--config", "settings.yaml", "--print-config"]) == 0
  assert capsys.readouterr().out == first
  # The command line wins over the file.
  assert main([argv[0], "--config", "settings.yaml", "--dtype", "float32",
               "--print-config"]) == 0
  assert yaml.safe_load(capsys.readouterr().out) == dict(settings, dtype="float32")


def test_defaults_to_the_checkpoints_own_dtype(tmp_path, capsys):
  """--dtype left out is "auto": eval ppl and convert keep a float32 checkpoint in float32."""
  from elastic_jax.convert.__main__ import main as convert
  from elastic_jax.eval.cli import main as evaluate
  with open(os.path.join(ROOT, "configs", "tiny_llama3.json")) as f:
    raw = json.load(f)
  cfg = config_from_hf_dict(raw)
  ej.save_pretrained(ej.ElasticModel(cfg, init_params(cfg, jax.random.key(3), "float32"), raw),
                     tmp_path / "m")
  (tmp_path / "ids.json").write_text(json.dumps([5, 17, 300, 2]))
  assert evaluate(["ppl", "--model", str(tmp_path / "m"), "--ids",
                   str(tmp_path / "ids.json")]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "float32"
  for extra in ([], ["--to-hf"]):
    out = tmp_path / f"out{len(extra)}"
    assert convert([str(tmp_path / "m"), str(out), "--quiet", *extra]) == 0
    assert ej.from_pretrained(out, dtype="auto", show_progress=False).dtype == "float32"
