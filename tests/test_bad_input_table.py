"""Bad input at the command lines, one row per case: the command, the exit status, the words
of its one-line message. A new CLI option's bad values join the table.

The entry points run in this process (their `main` through `run_cli`, as `python X` does), so
a row costs milliseconds, not an interpreter start. Every row also checks the promise: stderr
is one `error:` line (or argparse's usage and error), never a traceback.
"""

import contextlib
import errno
import importlib.util
import json
import os
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import elastic_jax as ej
from elastic_jax.cli import run_cli
from elastic_jax.config import config_from_hf_dict
from elastic_jax.model import init_params
from elastic_jax.router import RouterConfig, init_router_params
from toktools import make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
CFG = dict(model_type="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=2048)


def _module(name):
  spec = importlib.util.spec_from_file_location(f"entry_{name}", os.path.join(ROOT, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod   # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


def _routers(root, name, cfg, rcfg=RouterConfig(), extra=None, truncate=False):
  """A router export in our layout (as train.py writes it), possibly broken."""
  d = root / name
  d.mkdir()
  params = {f"router.{k}": np.asarray(v) for k, v in
            init_router_params(cfg, rcfg, jax.random.key(0)).items()}
  params.update(extra or {})
  save_file(params, d / "routers.safetensors")
  if truncate:
    data = (d / "routers.safetensors").read_bytes()
    (d / "routers.safetensors").write_bytes(data[:len(data) // 2])
  import dataclasses
  (d / "routers.json").write_text(json.dumps({
      "format": "elastic_jax.routers", "version": 1, "router": dataclasses.asdict(rcfg),
      "objective_targets": [0.7, 0.7, 1, 1, 1],
      "backbone": {"family": cfg.family, "num_layers": cfg.num_layers,
                   "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}}))
  return d


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad")
  cfg = config_from_hf_dict(CFG)
  model = ej.ElasticModel(cfg, init_params(cfg, jax.random.key(0), "float32"), cfg.to_hf_dict())
  ej.save_pretrained(model, root / "m")
  make_tokenizer(root / "m", ["the grass is green and the sky is blue"])
  ej.save_pretrained(model, root / "bare")                     # no tokenizer files
  other = config_from_hf_dict(dict(CFG, head_dim=8, hidden_size=32))
  _routers(root, "routers", cfg)
  _routers(root, "routers_head_dim", other)
  _routers(root, "routers_unknown", cfg, extra={"gate.bias": np.zeros(2, np.float32)})
  _routers(root, "routers_truncated", cfg, truncate=True)
  _routers(root, "routers_static", cfg, RouterConfig(static=True))
  _routers(root, "routers_no_task_mlp", cfg, RouterConfig(task_mlp=False),
           extra={"router.task_w1": np.zeros((2, 2), np.float32)})
  (root / "afile").write_text("x")
  (root / "ids_dict.json").write_text('{"ids": [1, 2, 3]}')
  (root / "ids.json").write_text("[1, 2, 3, 4]")
  small = root / "small_vocab"
  small_cfg = config_from_hf_dict(dict(CFG, vocab_size=64))
  ej.save_pretrained(ej.ElasticModel(small_cfg, init_params(small_cfg, jax.random.key(1),
                                                            "float32"), small_cfg.to_hf_dict()),
                     small)
  make_tokenizer(small, ["the grass is green and the sky is blue"])   # 300+ tokens > 64
  (root / "plan_empty.yaml").write_text("config: mixture.yaml\n")
  (root / "plan_static.yaml").write_text("runs:\n  s: {static_of: e, overrides: []}\n")
  (root / "scores.json").write_text(json.dumps({"items": [], "methods": {}}))
  (root / "data.jsonl").write_text(json.dumps({"context": "a", "question": "b", "answer": "c",
                                               "task": "code"}) + "\n")
  (root / "userexport" / "full_model").mkdir(parents=True)    # what a user keeps there
  (root / "userexport" / "full_model" / "notes.txt").write_text("mine")
  (root / "eval_unknown.yaml").write_text("command: ruler\nbatchsize: 2\n")
  (root / "eval_zero.yaml").write_text("batch_size: 0\n")
  (root / "eval_ppl.yaml").write_text("command: ppl\nmodel: m\n")
  (root / "eval_list.yaml").write_text("- ruler\n")
  return root


T = ("train", ["--config", TINY])
# id: (entry point, [base argv,] argv with {root} for the fixture's folder, exit status, words)
CASES = {
    "train tau 0": (*T, ["train.tau_init=0"], 2, "train.tau_init must be a finite temperature"),
    "train lr negative": (*T, ["train.lr=-1e-3"], 2, "train.lr must be a finite value > 0"),
    "train lambda lr 0": (*T, ["train.lambda_lr=0"], 2, "train.lambda_lr must be"),
    "train mlp chunk negative": (*T, ["model.mlp_chunk=-8"], 2,
                                 "model.mlp_chunk must be an integer >= 0, got -8"),
    "train log.dir under a file": (*T, ["log.dir={root}/afile/logs"], 2,
                                   "log.dir '{root}/afile/logs': cannot be created"),
    "train export.dir under a file": (*T, ["export.dir={root}/afile/x"], 2,
                                      "export.dir '{root}/afile/x': cannot be created"),
    "train run_dir is a file": (*T, ["run_dir={root}/afile"], 2, "is a file, not a directory"),
    "train export into the model": (*T, ["model.path={root}/m", "export.dir={root}/m"], 2,
                                    "export.dir {root}/m: the output is an input"),
    "train missing data": (*T, ["model.path={root}/m", "data.train_path={root}/nope.jsonl"], 2,
                           "data.train_path '{root}/nope.jsonl': no such file"),
    "train missing eval data": (*T, ["model.path={root}/m", "data.train_path={root}/data.jsonl",
                                     "data.eval_path={root}/nope.jsonl"], 2,
                                "data.eval_path '{root}/nope.jsonl': no such file"),
    "train tokenizer past vocab": (*T, ["model.path={root}/small_vocab",
                                        "data.train_path={root}/data.jsonl"], 2,
                                   "but the model's vocabulary has 64: ids 64.."),
    "train no tokenizer": (*T, ["model.path={root}/bare", "data.train_path={root}/data.jsonl"],
                           2, "holds no tokenizer files"),
    "train unknown key": (*T, ["train.stepz=3"], 2, "train.stepz"),
    "eval lengths abc": ("eval", ["ruler", "--model", "{root}/m", "--lengths", "abc"], 2,
                         "'abc' is not a whole number"),
    "eval samples 0": ("eval", ["ruler", "--model", "{root}/m", "--samples", "0"], 2,
                       "must be at least 1"),
    "eval out is a file": ("eval", ["ruler", "--model", "{root}/m", "--out", "{root}/afile"], 2,
                           "is a file, not a directory"),
    "eval out is the model": ("eval", ["ruler", "--model", "{root}/m", "--out", "{root}/m"], 2,
                              "the output is an input"),
    "eval routers head_dim": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                       "{root}/routers_head_dim"], 2,
                              "routers trained for a backbone with head_dim 8"),
    "eval routers unknown tensor": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                             "{root}/routers_unknown"], 2,
                                    "tensor 'gate.bias' is not a router or multiplier tensor"),
    "eval routers truncated": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                        "{root}/routers_truncated"], 2,
                               "unreadable, truncated or damaged"),
    "eval routers against their config": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                                  "{root}/routers_no_task_mlp"], 2,
                                          "task_mlp False): unexpected task_w1"),
    "eval routers missing": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                      "{root}/nowhere"], 2, "not a router export"),
    "eval static routers input-dependent": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                                    "{root}/routers", "--static-routers",
                                                    "{root}/routers"], 2,
                                            "input-dependent routers, not a static router"),
    "eval static routers missing": ("eval", ["ruler", "--model", "{root}/m", "--routers",
                                             "{root}/routers", "--static-routers",
                                             "{root}/nowhere"], 2, "not a router export"),
    "eval no tokenizer": ("eval", ["ruler", "--model", "{root}/bare"], 2,
                          "holds no tokenizer files"),
    "train full model onto a user's folder": (*T, ["export.full_model=true",
                                                   "export.dir={root}/userexport"], 2,
                                               "export.full_model: {root}/userexport/full_model "
                                               "holds what no train run exported there (e.g. "
                                               "notes.txt)"),
    "eval config unknown key": ("eval", ["ruler", "--config", "{root}/eval_unknown.yaml"], 2,
                                "'batchsize' is not a setting of ruler (did you mean "
                                "'batch_size'?)"),
    "eval config bad value": ("eval", ["ruler", "--config", "{root}/eval_zero.yaml"], 2,
                              "eval_zero.yaml: 'batch_size': must be at least 1, got 0"),
    "eval config of another command": ("eval", ["ruler", "--config", "{root}/eval_ppl.yaml"], 2,
                                       "holds the settings of 'ppl', not of 'ruler'"),
    "eval config not a mapping": ("eval", ["ppl", "--config", "{root}/eval_list.yaml"], 2,
                                  "the top level should be a mapping of settings, got list"),
    "eval config missing": ("eval", ["ppl", "--config", "configs/nope.yaml"], 2,
                            "configs/nope.yaml: no such settings file"),
    "eval ppl ids not a list": ("eval", ["ppl", "--model", "{root}/m", "--ids",
                                         "{root}/ids_dict.json"], 2,
                                "must hold a JSON list of token ids"),
    "eval ppl max-tokens 0": ("eval", ["ppl", "--model", "{root}/m", "--ids", "{root}/ids.json",
                                       "--max-tokens", "0"], 2, "must be at least 1"),
    "convert max-shard-gb nan": ("convert", ["{root}/m", "{root}/out", "--to-hf",
                                             "--max-shard-gb", "nan"], 2,
                                 "must be a finite number > 0"),
    "convert onto its source": ("convert", ["{root}/m", "{root}/m", "--overwrite"], 2,
                                "the output is an input"),
    "convert onto a parent of its source": ("convert", ["{root}/m", "{root}", "--overwrite"], 2,
                                            "the output contains an input"),
    "convert into its source": ("convert", ["{root}/m", "{root}/m/inner"], 2,
                                "the output lies inside an input"),
    "convert out under a file": ("convert", ["{root}/m", "{root}/afile/out"], 2,
                                 "cannot create the output's folder"),
    "convert routers and no routers": ("convert", ["{root}/m", "{root}/out2", "--routers",
                                                   "{root}/routers", "--no-routers"], 2,
                                       "exclude each other"),
    "pretrain resume without a state": ("pretrain", ["--out", "{root}/pt_none", "--resume"], 2,
                                        "does not exist"),
    "pretrain zero steps": ("pretrain", ["--out", "{root}/pt", "--total-steps", "0"], 2,
                            "--total-steps must be at least 1"),
    "pretrain row length": ("pretrain", ["--out", "{root}/pt", "--seq-len", "100"], 2,
                            "--seq-len must be a multiple of 128"),
    "pretrain eval lengths": ("pretrain", ["--out", "{root}/pt", "--eval-lengths", "384,abc"],
                              2, "comma-separated whole numbers"),
    "pretrain min lr above lr": ("pretrain", ["--out", "{root}/pt", "--min-lr", "1"], 2,
                                 "--min-lr in [0, --lr]"),
    "pretrain out under a file": ("pretrain", ["--out", "{root}/afile/pt"], 2,
                                  "cannot be created"),
    "pretrain rows past the positions": ("pretrain", ["--out", "{root}/pt", "--seq-len",
                                                      "8192"], 2, "within the config's"),
    "mixture data random wordings 2": ("mixture", ["{root}/mix", "--random-wordings", "2"], 2,
                                       "--random-wordings 2.0: a share in [0, 1]"),
    "mixture data unknown task": ("mixture", ["{root}/mix", "--tasks", "kv,xx"], 2,
                                  "--tasks: distinct names among"),
    "frontier heads keep a file that is not heads": ("frontier", ["heads", "--out",
                                                                 "{root}/scores.json", "--keep"],
                                                     2, "is not a heads file"),
    "frontier plan without runs": ("frontier", ["train", "{root}/plan_empty.yaml", "--out",
                                                "{root}/sweep"], 2,
                                   "a plan is a mapping with a non-empty 'runs' mapping"),
    "frontier plan static of no run": ("frontier", ["train", "{root}/plan_static.yaml", "--out",
                                                    "{root}/sweep"], 2,
                                       "static_of names no run of the plan (e)"),
    "frontier score nothing to score": ("frontier", ["score", "{root}/m", "--out",
                                                     "{root}/s.json"], 2, "no routers to score"),
    "frontier representations of a static router": ("frontier", ["representations",
                                                     "--routers", "{root}/routers_static"], 2,
                                                    "a static router has no task representation"),
    "frontier report unknown run": ("frontier", ["report", "{root}/scores.json", "--runs", "e9"],
                                    2, "no elastic run named e9"),
    "report kernel times without MSR 1": ("report", ["--run", "elastic={root}", "--plots",
                                                     "{root}/pl", "--kernel-times", "0:5,0.5:3"],
                                          2, "needs MSR 0 and 1"),
    "report kernel times not pairs": ("report", ["--run", "elastic={root}", "--plots",
                                                 "{root}/pl", "--kernel-times", "fast"], 2,
                                      "expected MSR:ms pairs"),
    "report kernel times without plots": ("report", ["--run", "elastic={root}", "--out",
                                                     "{root}/table.md", "--kernel-times",
                                                     "0:5,1:1"], 2, "pass --plots DIR too"),
    "report run without a report": ("report", ["--run", "elastic={root}", "--out",
                                               "{root}/table.md"], 2,
                                    "cannot read an eval report"),
    "report run not label=dir": ("report", ["--run", "{root}"], 2, "expected LABEL=DIR"),
    "report out under a file": ("report", ["--run", "elastic={root}", "--out",
                                           "{root}/afile/table.md"], 2, "is a file, not a directory"),
    "serve unknown decode impl": ("serve", ["{root}/m", "--num-pages", "8", "--decode-impl",
                                            "mosaic"], 2, "over pages 'mosaic' is not one of"),
    "serve prefill layers 0": ("serve", ["{root}/m", "--num-pages", "8", "--prefill-layers",
                                         "0"], 2, "prefill_layers must be an integer >= 1"),
    "serve bench budget out of range": ("benchmarks/serve", ["--dry-run", "--msr", "1.5"], 2,
                                        "--msr values lie in [0, 1)"),
    "serve bench negative prefill layers": ("benchmarks/serve", ["--dry-run", "--prefill-layers",
                                                                 "-1"], 2,
                                            "--prefill-layers values are >= 0"),
    "train bench negative mlp chunk": ("benchmarks/train_router", ["--dry-run", "--mlp-chunk",
                                                                   "-1"], 2,
                                       "--mlp-chunk must be >= 0"),
    "paged decode bench odd page size": ("benchmarks/decode_attention",
                                         ["--paged", "--dry-run", "--page-size", "24"], 2,
                                         "--page-size a power of two >= 16"),
    "serve bench one new token": ("benchmarks/serve", ["--dry-run", "--new-tokens", "1"], 2,
                                  "--new-tokens must be >= 2"),
    "kernel profile multicast in interpret mode": ("benchmarks/kernel_profile",
                                                   ["--dry-run", "--multicast"], 2,
                                                   "--multicast runs natively only"),
    "kernel profile cudnn in interpret mode": ("benchmarks/kernel_profile",
                                               ["--dry-run", "--kernel", "cudnn"], 2,
                                               "--kernel cudnn is a peer's causal forward"),
    "kernel profile trace in interpret mode": ("benchmarks/kernel_profile",
                                               ["--dry-run", "--trace", "unused"], 2,
                                               "--trace records the forward kernel's schedule"),
    "kernel profile q-registers in interpret mode": ("benchmarks/kernel_profile",
                                                     ["--dry-run", "--q-registers"], 2,
                                                     "--q-registers runs natively only"),
    "kernel profile q-registers on a backward kernel": ("benchmarks/kernel_profile",
                                                        ["--kernel", "dq", "--q-registers"], 2,
                                                        "are schedules of the forward kernels"),
    "kernel profile slots past shared memory": ("benchmarks/kernel_profile",
                                                ["--kernel", "dkv", "--slots", "2", "5"], 2,
                                                "the backward kernels take 2 to 4 slots"),
    "kernel profile registers on the forward": ("benchmarks/kernel_profile",
                                                ["--registers", "240"], 2,
                                                "are tiles of the Mosaic GPU backward"),
    "kernel profile triton under fa-xa": ("benchmarks/kernel_profile",
                                          ["--kernel", "dkv", "--triton", "--xa"], 2,
                                          "--triton times the Triton training kernels"),
    "attention bench unknown kernel variant": ("benchmarks/attention",
                                               ["--dry-run", "--mosaic-tiles",
                                                "64x128x2+multicst"], 2,
                                               "expected BQxBKVxSLOTS[+overlap|+chain]"),
    "attention bench chain with persistent programs": ("benchmarks/attention",
                                                       ["--dry-run", "--mosaic-tiles",
                                                        "64x128x2+chain+p132"], 2,
                                                       "(+chain without +pP)"),
}


def _main(entry):
  if entry == "convert":
    from elastic_jax.convert.__main__ import main
    return main
  if entry == "pretrain":
    from elastic_jax.repro.pretrain import main
    return main
  if entry == "mixture":
    from elastic_jax.eval.mixture import main
    return main
  if entry == "report":
    from elastic_jax.repro.report import main
    return main
  if entry == "frontier":
    from elastic_jax.repro.frontier import main
    return main
  if entry == "serve":
    pytest.importorskip("uvicorn")
    from elastic_jax.generation.server import main
    return main
  if entry.startswith("benchmarks/"):   # a benchmark imports its own folder's helpers
    folder = os.path.join(ROOT, "benchmarks")
    if folder not in sys.path:
      sys.path.insert(0, folder)
  return _module(entry).main


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_sentence(world, case, capsys, monkeypatch):
  row = CASES[case]
  entry, base, argv, status, words = row if len(row) == 5 else (row[0], [], *row[1:])
  monkeypatch.chdir(world)
  argv = [a.format(root=world) for a in base + argv]
  if entry == "train":
    argv.append(f"run_dir={world}/run_{case.replace(' ', '_')}")
    if any(a.startswith("run_dir=") for a in argv[:-1]):
      argv.pop()
  before = sorted(os.listdir(world))
  code = None
  try:
    code = run_cli(lambda: _main(entry)(argv))
  except SystemExit as e:            # argparse
    code = e.code
  err = capsys.readouterr().err
  assert code == status, (case, err)
  assert words.format(root=world) in err, (case, err)
  assert "Traceback" not in err
  lines = [l for l in err.strip().splitlines() if l.strip()]
  assert lines[-1].startswith(("error:", "usage:")) or ": error:" in lines[-1], err
  if lines[0].startswith("error:"):
    assert len(lines) == 1, err
  # Nothing new was written next to the inputs (no half-made outputs).
  assert sorted(os.listdir(world)) == before, case


def test_convert_refusals_keep_the_source(world):
  """The data-loss cases: after refusing OUT == SRC and OUT above SRC, SRC is whole."""
  m = ej.from_pretrained(world / "m", dtype="float32", show_progress=False)
  with pytest.raises(ej.ElasticJaxError, match="the output is the input"):
    ej.save_pretrained(m, world / "m", overwrite=True)
  with pytest.raises(ej.ElasticJaxError, match="the output contains the input"):
    ej.save_converted(m, world, overwrite=True)
  again = ej.from_pretrained(world / "m", dtype="float32", show_progress=False)
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_python_api_bad_input(world):
  from elastic_jax import hybrid_attention
  from elastic_jax.generation.generate import generate
  with pytest.raises(ej.ElasticJaxError, match="needs a directory path.*, got None"):
    ej.from_pretrained(None)
  m = ej.from_pretrained(world / "m", dtype="float32", show_progress=False)
  broken = ej.ElasticModel(m.config, {**m.params, "embed": np.zeros((3, 3), np.float32)},
                           m.hf_config)
  with pytest.raises(ej.ElasticJaxError, match=r"parameter \['embed'\] has shape \[3, 3\]"):
    ej.save_pretrained(broken, world / "never")
  assert not (world / "never").exists()
  with pytest.raises(ej.ElasticJaxError, match="integer token-id lists|token-id lists"):
    generate(m.params, m.config, "a prompt", attention="full")
  with pytest.raises(ej.ElasticJaxError, match="one integer >= 1 per prompt"):
    generate(m.params, m.config, [[1, 2], [3]], attention="full", max_new_tokens=[4, 0])
  with pytest.raises(ej.ElasticJaxError, match="tokens_per_sync must be >= 1, got 0"):
    generate(m.params, m.config, [[1, 2]], attention="full", tokens_per_sync=0)
  with pytest.raises(ej.ElasticJaxError, match="layer_loop must be auto, scan or split"):
    m.generate([[1, 2]], attention="full", layer_loop="unrolled")
  with pytest.raises(ej.ElasticJaxError, match="prefill_chunk must be None or an integer"):
    m.generate([[1, 2]], attention="full", prefill_chunk=0)
  with pytest.raises(ej.ElasticJaxError, match="pack must be None, True or False, got 'yes'"):
    m.generate([[1, 2]], attention="full", pack="yes")
  q, k = jax.numpy.ones((1, 8, 2, 4)), jax.numpy.ones((1, 8, 1, 4))
  for args, kw, words in (
      ((q, k[:, :4], k[:, :4], jax.numpy.ones((1, 1))), {}, "must share batch, length"),
      ((q, k, k, jax.numpy.full((1, 1), 1.5)), {}, "gate values must lie in [0, 1]"),
      ((q.astype(int), k, k, jax.numpy.ones((1, 1))), {}, "q must be a floating-point"),
      ((q, k, k, jax.numpy.ones((1, 1))), dict(patterns="fa-xa", xa_keep=jax.numpy.ones((1, 1))),
       "xa_keep is"),
      ((q, k, k, jax.numpy.ones((1, 1))), dict(patterns="xx"), "patterns 'xx' is unknown"),
      ((q, k, k, jax.numpy.ones((1, 1))), dict(segment_ids=jax.numpy.ones((1, 7), int)),
       "segment_ids must be integers [B, T]"),
      ((q, k.astype(jax.numpy.bfloat16), k.astype(jax.numpy.bfloat16), jax.numpy.ones((1, 1))),
       {}, "q, k and v must share a dtype, got float32, bfloat16 and bfloat16"),
      ((q[:, :0], k[:, :0], k[:, :0], jax.numpy.ones((1, 1))), {}, "q has an empty dimension"),
      ((q, k, k, jax.numpy.ones((1, 1))),
       dict(patterns="fa-xa", xa_block=0, xa_keep=jax.numpy.ones((1, 1, 1, 1), bool)),
       "xa_block must be a positive number of tokens, got 0"),
      ((q, k, k, jax.numpy.ones((1, 8, 1)).at[0, 5].set(0.0)), {},
       "gate, row 0: more than one gate per KV head along a row without segment_ids")):
    with pytest.raises(ej.ElasticJaxError) as err:
      hybrid_attention(*args, block=4, local_blocks=1, **kw)
    assert words in str(err.value)
  # The kernel builders and the Mosaic XA forward (ValueError: programming errors of a caller
  # that picks kernels itself).
  from elastic_jax.attention import Streaming, mosaic_gpu
  for packed in (False, True):
    for xa in (False, True):
      with pytest.raises(ValueError, match="training kernels 'cuda' are unknown"):
        mosaic_gpu.make_hybrid(training="cuda", packed=packed, xa=xa)
  q64, k64 = jax.numpy.ones((1, 128, 2, 64), jax.numpy.bfloat16), jax.numpy.ones(
      (1, 128, 2, 64), jax.numpy.bfloat16)
  # Every builder's function checks that its arrays fit together before any kernel runs.
  from elastic_jax.attention import pallas_gpu, pallas_tpu
  st, g2, ids = Streaming(1, 1, 128), jax.numpy.ones((1, 2)), jax.numpy.ones((1, 128), int)
  for fn, args, words in (
      (mosaic_gpu.make_hybrid(), (q64, k64[:, :64], k64[:, :64], g2, st, True),
       "do not fit: q is [B, T, N, H] and k, v [B, T, K, H]"),
      (pallas_gpu.make_hybrid(), (q64[:, :, :1], k64, k64, g2, st, True), "do not fit"),
      (pallas_tpu.make_hybrid(), (q64, k64.astype(jax.numpy.float32), k64, g2, st, True),
       "must share one floating dtype, got bfloat16, float32 and bfloat16"),
      (mosaic_gpu.make_hybrid(), (q64, k64, k64, jax.numpy.ones((1, 4)), st, True),
       "the gate has shape [1, 4]; [1, 2] expected"),
      (mosaic_gpu.make_hybrid(packed=True), (q64, k64, k64, g2, ids, ids, st, True),
       "the gate has shape [1, 2]; [1, 128, 2] expected"),
      (pallas_gpu.make_hybrid(packed=True),
       (q64, k64, k64, jax.numpy.ones((1, 128, 2)), ids.astype(float), ids, st, True),
       "the segment ids are float"),
      (pallas_gpu.make_hybrid(xa=True), (q64, k64, k64, g2, jax.numpy.ones((1, 2, 1, 1), bool),
                                         st, "fa-xa", 64, True),
       "xa_keep has shape [1, 2, 1, 1]; [1, 2, 2, 2] expected for 128 tokens in blocks of 64")):
    with pytest.raises(ValueError) as err:
      fn(*args)
    assert words in str(err.value), str(err.value)
  # The plain reference too: its gathers would clamp a misshapen xa_keep silently.
  from elastic_jax.attention import hybrid_attention as reference
  q16, k16 = jax.numpy.ones((1, 64, 4, 16)), jax.numpy.ones((1, 64, 2, 16))
  g16 = jax.numpy.ones((1, 64, 2))
  for args, kw, words in (
      ((q16, k16, k16, g16), dict(patterns="fa-xa", xa_block=16,
                                  xa_keep=jax.numpy.ones((1, 2, 2, 2), bool)),
       "xa_keep has shape [1, 2, 2, 2]; [1, 2, 4, 4] expected for 64 tokens in blocks of 16"),
      ((q16, k16[:, :32], k16[:, :32], g16), {}, "do not fit: q is [B, T, N, H]"),
      ((q16, k16, k16, g16[:, 0]), {}, "the gate has shape [1, 2]; [1, 64, 2] expected")):
    with pytest.raises(ValueError) as err:
      reference(*args, Streaming(1, 1, 16), **kw)
    assert words in str(err.value), str(err.value)
  with pytest.raises(ValueError, match="runs the XAttention settings, not 'fa-ssa'"):
    mosaic_gpu.xa_forward_hard(q64, k64, k64, jax.numpy.ones((1, 2)),
                               jax.numpy.ones((1, 2, 1, 1), bool), Streaming(1, 1, 128),
                               patterns="fa-ssa", xa_block=128, interpret=True)
  for kw, words in ((dict(patterns="fa-ssa", xa_block=128), "not 'fa-ssa'"),
                    (dict(patterns="fa-xa", xa_block=64), "do not take XAttention blocks of 64"),
                    (dict(patterns="fa-xa", xa_block=128, xa_keep=jax.numpy.ones((1, 2, 2, 2),
                                                                                  bool)),
                     "xa_keep has shape")):
    kw = dict(dict(xa_keep=jax.numpy.ones((1, 2, 1, 1), bool)), **kw)
    with pytest.raises(ValueError, match=words):
      mosaic_gpu.xa_forward_train(q64, k64, k64, jax.numpy.ones((1, 2)), kw.pop("xa_keep"),
                                  Streaming(1, 1, 128), interpret=True, **kw)
  ids = jax.numpy.zeros((1, 128), int)
  keep = lambda n: jax.numpy.ones((1, 2, n, n), bool)
  # The two packed XA entry points: the same rows, their own words for the blocks they refuse,
  # and the forward's tiles.
  packed = ((mosaic_gpu.packed_xa_forward_train,
             "do not take packed rows with XAttention blocks of 64", ()),
            (mosaic_gpu.packed_xa_forward_hard, "does not take XAttention blocks of 64",
             ((dict(patterns="fa-xa", xa_block=128,
                    tiles=mosaic_gpu.Tiles(persistent=-1, chain=False)), "does not take"),)))
  for fn, block_words, extra in packed:
    for kw, words in ((dict(patterns="fa-ssa", xa_block=128), "not 'fa-ssa'"),
                      (dict(patterns="fa-xa", xa_block=64), block_words),
                      (dict(patterns="fa-xa", xa_block=128, xa_keep=keep(2)),
                       "xa_keep has shape"), *extra):
      kw = dict(dict(xa_keep=keep(1)), **kw)
      with pytest.raises(ValueError, match=words):
        fn(q64, k64, k64, jax.numpy.ones((1, 128, 2)), ids, ids, kw.pop("xa_keep"),
           Streaming(1, 1, 128), interpret=True, **kw)
  from elastic_jax.attention.xattention import XAttention
  with pytest.raises(ValueError, match="unroll_chunks must be non-negative"):
    XAttention(unroll_chunks=-1)


def test_nan_weights_warn_at_conversion(world, tmp_path):
  from safetensors.numpy import load_file
  src = tmp_path / "nan"
  import shutil
  shutil.copytree(world / "m", src)
  tensors = load_file(src / "model.safetensors")
  tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = np.nan
  save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="tensor 'model.layers.1.mlp.up_proj.weight' holds NaN"):
    ej.from_pretrained(src, dtype="float32", show_progress=False)


def test_stale_partials_are_removed_and_overwriting_a_file_leaves_nothing(world, tmp_path):
  m = ej.from_pretrained(world / "m", dtype="float32", show_progress=False)
  dead = tmp_path / ".out.partial-999999999-abcdef01"      # a run that was killed
  old_layout = tmp_path / ".out.partial-1a2b3c4d"          # left by an older version
  alive = tmp_path / f".out.partial-{os.getpid()}-00000000"  # a live writer: kept
  for d in (dead, old_layout, alive):
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
  ej.save_pretrained(m, tmp_path / "out")
  assert not dead.exists() and not old_layout.exists() and alive.exists()
  (tmp_path / "file_target").write_text("a file")
  ej.save_pretrained(m, tmp_path / "file_target", overwrite=True)
  assert (tmp_path / "file_target" / "config.json").exists()
  assert sorted(p.name for p in tmp_path.iterdir()
                if p.name.startswith(".file_target")) == []


def test_run_directory_lock(tmp_path, capsys):
  """A second train.py on a run_dir in use is refused naming the holder; a lock left by a
  process that died is taken over."""
  from elastic_jax.files import DirectoryLock
  run = tmp_path / "run"
  with DirectoryLock(str(run)):
    code = run_cli(lambda: _module("train").main(["--config", TINY, f"run_dir={run}"]))
    err = capsys.readouterr().err
    assert code == 2 and f"{run}: this run directory is in use by process {os.getpid()}" in err
  assert not run.exists()          # made by the lock, left empty: removed again
  # A killed run leaves the file with its pid, but the kernel dropped its lock.
  run.mkdir()
  (run / ".lock").write_text(json.dumps({"pid": 999999999, "started": "2026-01-01 00:00:00"}))
  with DirectoryLock(str(run)) as lock:
    assert lock.taken_over == "process 999999999 (started 2026-01-01 00:00:00)"


def test_torn_predictions_line_is_dropped_once(tmp_path):
  from elastic_jax.eval.runner import read_predictions
  from elastic_jax.files import repair_jsonl_tail
  path = tmp_path / "predictions.jsonl"
  good = json.dumps({"attention": "full", "key": "a", "prediction": "x"})
  path.write_text(good + "\n" + '{"attention": "full", "ke')
  assert repair_jsonl_tail(str(path))
  assert path.read_text() == good + "\n"
  with open(path, "a") as f:            # the next run appends after it: still readable
    f.write(json.dumps({"attention": "full", "key": "b", "prediction": "y"}) + "\n")
  assert set(read_predictions(str(path))) == {("full", "a"), ("full", "b")}
  path.write_text(good)                 # complete but no newline: one is added
  assert repair_jsonl_tail(str(path)) and path.read_text() == good + "\n"
  assert not repair_jsonl_tail(str(path))


def _train_in_process(argv):
  return run_cli(lambda: _module("train").main(["--config", TINY, "train.steps=4",
                                                "data.seq_len=64", "log.every_steps=1",
                                                *argv]))


@contextlib.contextmanager
def _full_disk(tmp_path, monkeypatch):
  """A folder on a 200 KB tmpfs (a checkpoint does not fit); where mounting is not allowed,
  orbax's save raises the error a full disk gives instead."""
  mount = tmp_path / "tiny"
  mount.mkdir()
  mounted = os.system(f"mount -t tmpfs -o size=200k tmpfs {mount} 2>/dev/null") == 0
  if not mounted:
    import orbax.checkpoint as ocp

    def full(*args, **kwargs):
      raise OSError(28, "No space left on device")
    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
  try:
    yield mount
  finally:
    if mounted:
      os.system(f"umount {mount}")


def test_full_disk_during_a_checkpoint_is_one_sentence(tmp_path, capsys, monkeypatch):
  with _full_disk(tmp_path, monkeypatch) as disk:
    code = _train_in_process(["checkpoint.every_steps=2", f"checkpoint.dir={disk}/ck",
                              f"run_dir={tmp_path}/run"])
  err = capsys.readouterr().err
  assert code == 2, err
  assert err.strip().splitlines() == [
      f"error: {disk}/ck: checkpoint step 2 could not be written (No space left on device); "
      "earlier checkpoints are intact"]
  assert not (tmp_path / "run" / "export").exists()


def _one_error_line(err: str) -> str:
  """The one `error:` line of stderr; progress bars (tqdm's `desc: n%|...| i/N [...]`) aside."""
  import re
  lines = [l for l in err.strip().splitlines()
           if l.strip() and not re.search(r"\|\s*\d+/\d+ \[", l)]
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  return lines[0]


@contextlib.contextmanager
def _read_only(path):
  """A folder nothing can be written in: chmod for a user, a read-only tmpfs for root (whom
  chmod does not stop); skipped where neither works."""
  path.mkdir()
  if os.geteuid() != 0:
    path.chmod(0o555)
    try:
      yield path
    finally:
      path.chmod(0o755)
    return
  if os.system(f"mount -t tmpfs -o ro,size=64k tmpfs {path} 2>/dev/null") != 0:
    pytest.skip("running as root, where chmod does not stop writes, and cannot mount")
  try:
    yield path
  finally:
    os.system(f"umount {path}")


def test_read_only_outputs_are_one_sentence(world, tmp_path, capsys):
  """A read-only --out, log.dir or convert output: one line naming it, before any work."""
  with _read_only(tmp_path / "ro") as ro:
    cases = (("eval", ["ruler", "--model", f"{world}/m", "--out", f"{ro}/ev"],
              f"--out '{ro}/ev': cannot be created ({ro} is not writable)"),
             ("train", ["--config", TINY, f"log.dir={ro}/logs", f"run_dir={tmp_path}/run"],
              f"log.dir '{ro}/logs': cannot be created ({ro} is not writable)"),
             ("convert", [f"{world}/m", f"{ro}/out", "--quiet"], f"{ro}: cannot write there"))
    for entry, argv, words in cases:
      assert run_cli(lambda: _main(entry)(argv)) == 2, entry
      line = _one_error_line(capsys.readouterr().err)
      assert words in line, (entry, line)
    assert os.listdir(ro) == []


class _FillsUp:
  """A file that takes half of a write, then is full (as a disk that fills up mid-write)."""

  def __init__(self, f):
    self.f = f

  def write(self, data):
    self.f.write(bytes(data[:max(1, len(data) // 2)]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def __getattr__(self, name):
    return getattr(self.f, name)


def test_append_whole_cuts_a_torn_line_back(tmp_path):
  from elastic_jax.files import append_whole
  path = tmp_path / "x.jsonl"
  with open(path, "ab", buffering=0) as f:
    append_whole(f, b'{"a": 1}\n')
    with pytest.raises(OSError):
      append_whole(_FillsUp(f), b'{"b": 2}\n')
  assert path.read_bytes() == b'{"a": 1}\n'


def test_eval_output_is_locked_and_a_full_disk_is_one_sentence(world, tmp_path, capsys,
                                                               monkeypatch):
  """Two runs on one --out: the second is refused while the first lives (also with
  --overwrite, which then removes nothing); a lock whose process died is taken over. A disk
  that fills up while predictions are written: one line, no torn record."""
  from elastic_jax.eval import runner
  from elastic_jax.files import DirectoryLock
  out = tmp_path / "ev"
  base = ["ruler", "--model", f"{world}/m", "--lengths", "512", "--tasks", "niah_single_1",
          "--samples", "2", "--attention", "full", "--attn-impl", "reference", "--out",
          str(out)]
  evaluate = lambda *extra: run_cli(lambda: _main("eval")([*base, *extra]))
  out.mkdir()
  (out / ".lock").write_text(json.dumps({"pid": 999999999, "started": "2026-01-01 00:00:00"}))
  assert evaluate() == 0, capsys.readouterr().err
  assert f"{out} was locked by process 999999999" in capsys.readouterr().out
  predictions = (out / "predictions.jsonl").read_text()
  assert len(predictions.splitlines()) == 2
  with DirectoryLock(str(out), "eval output directory"):
    for extra in ([], ["--overwrite", "--dtype", "bfloat16"]):
      assert evaluate(*extra) == 2
      line = _one_error_line(capsys.readouterr().err)
      assert f"{out}: this eval output directory is in use by process {os.getpid()}" in line
      assert (out / "predictions.jsonl").read_text() == predictions
  # The disk fills up at the second record.
  full = tmp_path / "full"
  real = runner.append_whole
  writes = []

  def append(f, data):
    writes.append(data)
    real(f if len(writes) < 2 else _FillsUp(f), data)
  monkeypatch.setattr(runner, "append_whole", append)
  code = run_cli(lambda: _main("eval")([*base[:-1], str(full)]))
  line = _one_error_line(capsys.readouterr().err)
  assert code == 2 and line == (
      f"error: {full}/predictions.jsonl: could not be written (No space left on device); the "
      "predictions written before are kept, and a rerun goes on from them")
  kept = (full / "predictions.jsonl").read_text().splitlines()
  assert len(kept) == 1 and json.loads(kept[0])["key"] == "niah_single_1/512/0"
  assert not (full / ".lock").read_text()


@pytest.mark.parametrize("to_hf", [False, True])
def test_full_disk_in_convert_is_one_sentence(world, tmp_path, capsys, monkeypatch, to_hf):
  """Both formats: one line naming the output, nothing left there, an output there before
  kept as it was (the orbax path fails as tensorstore words it)."""
  from elastic_jax.convert import hf, native

  def full_hf(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def full_orbax(*args, **kwargs):
    raise ValueError("RESOURCE_EXHAUSTED: Error writing \"x/0.0\" in OCDBT database: Failed to "
                     "write 347045 bytes to file 14: No space left on device "
                     "[os_error_code='28']")
  monkeypatch.setattr(hf, "write_hf_safetensors", full_hf)
  monkeypatch.setattr(native, "save_params", full_orbax)
  out = tmp_path / "out"
  argv = [f"{world}/m", str(out), "--quiet"] + (["--to-hf"] if to_hf else [])
  assert run_cli(lambda: _main("convert")(argv)) == 2
  assert _one_error_line(capsys.readouterr().err) == (
      f"error: {out}: could not be written (No space left on device); nothing was left there")
  assert os.listdir(tmp_path) == []
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  assert run_cli(lambda: _main("convert")(argv + ["--overwrite"])) == 2
  assert "; the one there before is kept" in _one_error_line(capsys.readouterr().err)
  assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]


def test_full_disk_in_the_router_export_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
  """The routers' export after training fails on a full disk: one line, no export folder
  left, the last checkpoint kept; the same command then exports from it."""
  from elastic_jax import router_io
  run = tmp_path / "run"

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  with monkeypatch.context() as m:
    m.setattr(router_io, "save_file", full)
    code = _train_in_process([f"run_dir={run}", "data.synthetic.eval_batches=0"])
  line = _one_error_line(capsys.readouterr().err)
  assert code == 2 and line == (
      f"error: {run}/export/elastic_jax: could not be written (No space left on device); "
      f"nothing was left there; the trained routers are kept in the last checkpoint "
      f"({run}/checkpoints), and the same command exports them again")
  assert not (run / "export").exists() and (run / "checkpoints" / "4").is_dir()
  assert _train_in_process([f"run_dir={run}", "data.synthetic.eval_batches=0"]) == 0
  assert "nothing left to train" in capsys.readouterr().out
  assert (run / "export" / "elastic_jax" / "routers.json").is_file()


def test_full_model_export_replaces_only_its_own(tmp_path, capsys):
  """export.full_model: a resumed run exports again over its own export; a folder holding a
  user's files is refused before training, untouched; export.overwrite=true replaces it."""
  run = tmp_path / "run"
  # A router the authors' layout holds (blocks of 128, 100 boundary tokens).
  argv = [f"run_dir={run}", "export.full_model=true", "data.seq_len=256", "router.block=128",
          "router.boundary=100", "router.local_blocks=1", "data.synthetic.eval_batches=0"]
  assert _train_in_process(argv) == 0, capsys.readouterr().err
  full = run / "export" / "full_model"
  assert (full / "config.json").is_file()
  assert _train_in_process(argv) == 0, capsys.readouterr().err      # resumed: exports again
  (full / "notes.txt").write_text("mine")
  assert _train_in_process(argv) == 2
  line = _one_error_line(capsys.readouterr().err)
  assert f"export.full_model: {full} holds what no train run exported there (e.g. notes.txt)" \
      in line and "export.overwrite=true" in line
  assert (full / "notes.txt").read_text() == "mine"
  assert _train_in_process(argv + ["export.overwrite=true"]) == 0, capsys.readouterr().err
  assert not (full / "notes.txt").exists() and (full / "config.json").is_file()


def test_non_finite_loss_stops_and_saves_nothing(world, tmp_path, capsys):
  """A backbone that holds NaN: the run stops at step 1 naming it; no checkpoint, no export."""
  from safetensors.numpy import load_file
  import shutil
  src = tmp_path / "nan_model"
  shutil.copytree(world / "m", src)
  tensors = load_file(src / "model.safetensors")
  tensors["model.norm.weight"][:] = np.nan
  save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="holds NaN"):
    code = _train_in_process([f"model.path={src}", "checkpoint.every_steps=2",
                              f"run_dir={tmp_path}/run"])
  captured = capsys.readouterr()
  assert code == 2
  assert "error: step 1: the loss or a router gradient is not finite" in captured.err
  assert "loss nan" not in captured.out
  assert not (tmp_path / "run" / "export").exists()
  assert not [p for p in (tmp_path / "run" / "checkpoints").glob("*") if p.name[0].isdigit()]


def test_ruler_length_search_is_bounded():
  """A tokenizer that encodes everything to nothing cannot make the haystack grow without
  bound: the search stops with one sentence."""
  from elastic_jax.eval import ruler

  def empty(text, add_special_tokens=False, verbose=False):
    return {"input_ids": []}
  with pytest.raises(ej.ElasticJaxError, match="does not grow in tokens"):
    ruler.generate("niah_single_1", empty, 4096, 1)
