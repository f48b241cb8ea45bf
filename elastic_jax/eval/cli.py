"""The evaluation command (`eval.py`, `elastic-jax-eval`): parse, build, call.

    eval.py {ruler,longbench,longbench-v2,mixture,ppl} [options]

A benchmark (eval/benchmarks.py) makes the items; the runner (eval/runner.py) generates under
each way of attending (heads.ATTENTION) and keeps predictions.jsonl; the report
(eval/report.py) scores, writes report.json / report.md and plots. An output directory is
reused only for predictions the same model, weights, routers, dtype, implementation, pattern
pair, chat mode and seed made (setting.json; --overwrite starts over).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval.benchmarks import BENCHMARKS, csv, positive_int, resolve_model

USAGE = """Long-context quality, sparsity and speed of a model, elastic against full attention
and fixed baselines, on benchmarks generated or read locally (nothing is downloaded):

  eval.py ruler --model DIR [--routers R] --lengths 4096,8192 \\
      --tasks niah_single_1,niah_multikey_1,vt,cwe [--samples 8] [--out runs/eval_ruler]
  eval.py longbench --model DIR [--routers R] --data LB_DIR [--datasets a,b] [--e]
  eval.py longbench-v2 --model DIR [--routers R] --data LB2_DIR
  eval.py mixture [--model DIR] [--routers R] [--lengths 384] [--heldout-lengths 896]
  eval.py ppl --model DIR --text FILE          # next-token loss, full attention

DIR: an HF directory (safetensors; the authors' released models carry their own routers) or
one `python -m elastic_jax.convert` wrote, with its tokenizer files. R: the routers train.py
exported (runs/X/export/elastic_jax). --attention picks how heads attend (full, elastic,
sparse, static; default full,elastic,static with routers, else full,sparse). The output
directory gets predictions.jsonl (resumable), report.json, report.md (the paper's Table 1
layout) and PNG plots. LongBench data: the published JSONL files of THUDM/LongBench
(data/*.jsonl; LongBench-E: *_e.jsonl) or LongBench-v2's data.json, in --data.
"""
PROVENANCE_VERSION = 2


def _common(p: argparse.ArgumentParser, benchmark) -> None:
  default = benchmark.model_default
  p.add_argument("--model", required=default is None, default=None,
                 help="model directory (with tokenizer files)"
                 + ("; default: the shipped backbone" if default else ""))
  p.add_argument("--routers", help="router export directory (train.py's export/elastic_jax); "
                                   "default: the model directory's own routers, if any")
  p.add_argument("--attention", help="comma-separated ways heads attend: full, elastic, "
                                     "sparse, static")
  p.add_argument("--out", help="output directory (default runs/eval_<benchmark>)")
  p.add_argument("--overwrite", action="store_true",
                 help="start over in --out: drop predictions another model, routers, dtype, "
                      "implementation or pattern pair made there (default: refuse to mix them)")
  p.add_argument("--dtype", default=benchmark.dtype_default)
  p.add_argument("--attn-impl", default="auto", help="attention implementation (default auto)")
  from elastic_jax.attention.reference import PATTERN_PAIRS
  p.add_argument("--patterns", choices=PATTERN_PAIRS,
                 help="the pattern pair, what full- and sparse-routed heads run (default: the "
                      "routers', else fa-ssa); xa = XAttention's content-chosen blocks")
  p.add_argument("--xa-threshold", type=float, help="XAttention's mass threshold (default 0.9)")
  p.add_argument("--batch-size", type=positive_int, default=1)
  p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                 help="wrap prompts in the tokenizer's chat template (auto: when it has one)")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="eval.py", description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  for name, benchmark in BENCHMARKS.items():
    b = sub.add_parser(name, help=benchmark.help)
    _common(b, benchmark)
    benchmark.add_arguments(b)
  pp = sub.add_parser("ppl", help="next-token loss and perplexity of a text, full attention")
  pp.add_argument("--model", required=True)
  src = pp.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="UTF-8 text file, tokenized with DIR's tokenizer")
  src.add_argument("--ids", help="JSON file holding a list of token ids")
  pp.add_argument("--dtype", default="bfloat16")
  pp.add_argument("--max-tokens", type=positive_int, default=4096)
  return p


# ----------------------------------------------------------------------------------------------
# Model, routers, provenance


def load(args):
  """(model with its routers and pattern pair, tokenizer): --routers, else the directory's
  own routers (the authors' released models carry theirs), else none."""
  import elastic_jax as ej
  from elastic_jax.tokenizer import load_tokenizer
  model = ej.from_pretrained(args.model, dtype=args.dtype, show_progress=False,
                             routers=args.routers)
  tokenizer = load_tokenizer(args.model)
  if model.router_params is not None and not args.routers:
    r = model.router_config
    print(f"routers: the model directory's own ({r.patterns}, sink {r.sink_blocks} + window "
          f"{r.local_blocks} blocks of {r.block})", flush=True)
  changes = {k: v for k, v in (("patterns", args.patterns), ("xa_threshold", args.xa_threshold))
             if v is not None}
  if changes:
    try:
      rcfg = dataclasses.replace(model.router_config, **changes)
    except ValueError as e:
      raise ElasticJaxError(str(e)) from None
    model = dataclasses.replace(model, router_config=rcfg)
  return model, tokenizer


def _files_digest(root: str, names) -> str:
  """sha256 of (name, size, mtime) of each file: which weights, without reading them."""
  h = hashlib.sha256()
  for name in sorted(names):
    st = os.stat(os.path.join(root, name))
    h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:16]


def provenance(args, model) -> dict:
  """What produced predictions: reused on a rerun only if all of it is the same."""
  import jax
  root = os.path.realpath(args.model)
  weights = []
  for dirpath, _, files in os.walk(root):
    for f in files:
      if f.endswith((".safetensors", ".bin", ".json")) or "/params" in dirpath:
        weights.append(os.path.relpath(os.path.join(dirpath, f), root))
  routers = None
  if model.router_params is not None:
    h = hashlib.sha256()
    for k in sorted(model.router_params):
      h.update(k.encode() + np.asarray(jax.device_get(model.router_params[k])).tobytes())
    routers = h.hexdigest()[:16]
  rcfg = model.router_config
  return {"format": PROVENANCE_VERSION, "patterns": rcfg.patterns,
          **({"xa_threshold": rcfg.xa_threshold} if rcfg.uses_xattention else {}),
          "model": root, "weights": _files_digest(root, weights), "routers": routers,
          "dtype": args.dtype, "attn_impl": args.attn_impl, "chat": args.chat,
          "seed": getattr(args, "seed", None)}


def check_provenance(out: str, record: dict, overwrite: bool) -> None:
  """Refuses an output directory holding predictions something else made (setting.json);
  with `overwrite`, starts over there."""
  from elastic_jax.files import atomic_write_text
  path = os.path.join(out, "setting.json")
  if os.path.exists(path) and not overwrite:
    try:
      with open(path, encoding="utf-8") as f:
        before = json.load(f)
      if not isinstance(before, dict):
        raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
      raise ElasticJaxError(f"{path} cannot be read ({e}); pass another --out, or --overwrite "
                            "to start over there") from None
    diff = [k for k in record if before.get(k, "(not recorded)") != record[k]]
    if diff:
      k = diff[0]
      raise ElasticJaxError(f"{out} holds predictions made with {k} "
                            f"{before.get(k, '(not recorded)')!r}, not {record[k]!r}: pass "
                            "another --out, or --overwrite to start over there")
    return
  if overwrite:
    for name in ("predictions.jsonl", "setting.json", "report.json", "report.md"):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, name))
  os.makedirs(out, exist_ok=True)
  atomic_write_text(path, json.dumps(record) + "\n")


def check_out(out: str, args) -> None:
  from elastic_jax.files import check_apart
  if os.path.exists(out) and not os.path.isdir(out):
    raise ElasticJaxError(f"--out {out}: is a file, not a directory")
  check_apart(out, [args.model, getattr(args, "routers", None), getattr(args, "data", None)],
              "an input (--model, --routers or --data)")


# ----------------------------------------------------------------------------------------------
# Running


def default_attention(args, has_routers: bool) -> list[str]:
  if args.attention:
    return csv(args.attention)
  if not has_routers:
    return ["full", "sparse"]
  return (["full", "elastic", "sparse", "static"] if args.command == "mixture"
          else ["full", "elastic", "static"])


def note_window_covers_prompts(rcfg, attention, items) -> None:
  """Say so when streaming heads would see every key of every prompt (a window meant for long
  inputs, or no --routers on a model trained with a small one): sparse then equals full."""
  if "ssa" not in rcfg.patterns or not items or set(attention) <= {"full"}:
    return
  st = rcfg.streaming
  reach = (st.sink_blocks + st.local_blocks) * st.block
  longest = max(len(it.prompt_ids) for it in items)
  if reach >= longest:
    print(f"note: the streaming window (sink {st.sink_blocks} + local {st.local_blocks} blocks "
          f"of {st.block} = {reach} tokens) covers the longest prompt ({longest} tokens), so "
          f"streaming heads attend as full ones here; pass --routers (their window) to compare "
          f"them", flush=True)


def run_benchmark(args) -> int:
  import jax
  from elastic_jax.eval import report, runner
  benchmark = BENCHMARKS[args.command]
  resolve_model(args, benchmark)
  if args.out:
    check_out(args.out, args)
  model, tokenizer = load(args)
  attention = default_attention(args, model.router_params is not None)
  runner.check_attention_list(attention, model.router_params)
  items = benchmark.items(args, tokenizer, model.config.max_length)
  rcfg = model.router_config
  note_window_covers_prompts(rcfg, attention, items)
  out = args.out or os.path.join(
      "runs", f"eval_{args.command.replace('-', '_')}"
      + ("" if rcfg.patterns == "fa-ssa" else f"_{rcfg.patterns}"))
  check_provenance(out, provenance(args, model), args.overwrite)
  t0 = time.perf_counter()
  records = runner.run(model, tokenizer, items, attention, out, batch_size=args.batch_size,
                       attn_impl=args.attn_impl)
  summary = report.summarize(records, items, benchmark.score, benchmark.category)
  name = os.path.basename(os.path.normpath(args.model))
  meta = {"benchmark": args.command, "model": name, "attention_requested": attention,
          "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
          "items": len(items), "patterns": rcfg.patterns,
          **({"xa_threshold": rcfg.xa_threshold} if rcfg.uses_xattention else {})}
  targets = _targets(model, benchmark, items)
  paths = report.write(summary, records, out, f"{args.command}: {name}", meta, targets)
  with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
    print(f.read())
  print(f"wrote {', '.join(paths)} ({time.perf_counter() - t0:.0f} s)")
  return 0


def _targets(model, benchmark, items) -> dict[str, float]:
  """Target MSR per task, where the routers' objective targets and the task's type are known
  (drawn on the MSR plot)."""
  from elastic_jax.tasks import TASK_TYPES
  targets = getattr(model, "objective_targets", None)
  if not targets:
    return {}
  out = {}
  for it in items:
    kind = benchmark.task_type(it.task)
    if kind in TASK_TYPES:
      out[it.task] = float(targets[TASK_TYPES.index(kind)])
  return out


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "ppl":
    from elastic_jax.eval.perplexity import perplexity
    return perplexity(args.model, args.dtype, text=args.text, ids=args.ids,
                      max_tokens=args.max_tokens)
  return run_benchmark(args)


def console() -> int:
  """Entry point of the `elastic-jax-eval` command."""
  import sys
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
