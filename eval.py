"""python eval.py {ruler,longbench,longbench-v2,mixture,ppl} ...

Long-context quality, sparsity and speed of a converted model, elastic against full attention
and fixed baselines, on benchmarks generated or read locally (nothing is downloaded):

  python eval.py ruler --model DIR [--routers R] --lengths 4096,8192 \\
      --tasks niah_single_1,niah_multikey_1,vt,cwe [--samples 8] [--out runs/eval_ruler]
  python eval.py longbench --model DIR [--routers R] --data LB_DIR [--datasets a,b] [--e]
  python eval.py longbench-v2 --model DIR [--routers R] --data LB2_DIR
  python eval.py mixture [--model DIR] [--routers R] [--lengths 384] \\
      [--heldout-lengths 896] [--samples 8]   # the reproduction's tasks, shipped backbone
  python eval.py ppl --model DIR --text FILE          # next-token loss, full attention

DIR: an HF directory (safetensors) or one `python -m elastic_jax.convert` wrote, with its
tokenizer files. R: the routers `train.py` exported (runs/X/export/elastic_jax). --attention
picks the settings (full, elastic, sparse, static; default full,elastic,static with routers,
else full,sparse). The output directory gets predictions.jsonl (resumable: a rerun skips the
items already there), report.json, report.md (the paper's Table 1 layout) and PNG plots.
LongBench data: the published JSONL files of THUDM/LongBench (data/*.jsonl; LongBench-E:
*_e.jsonl) or LongBench-v2's data.json, in --data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import numpy as np


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def _int_list(text: str) -> str:
  items = [x.strip() for x in text.split(",") if x.strip()]
  if not items:
    raise argparse.ArgumentTypeError("needs at least one value")
  for x in items:
    _positive_int(x)
  return text


def _common(p, model_default=None, dtype_default="bfloat16"):
  p.add_argument("--model", required=model_default is None, default=model_default,
                 help="model directory (with tokenizer files)"
                 + (f"; default {model_default}" if model_default else ""))
  p.add_argument("--routers", help="router export directory (train.py's export/elastic_jax); "
                                   "default: the model directory's own routers, if any (the "
                                   "authors' released models)")
  p.add_argument("--attention", help="comma-separated settings: full,elastic,sparse,static")
  p.add_argument("--out", help="output directory (default runs/eval_<benchmark>)")
  p.add_argument("--overwrite", action="store_true",
                 help="start over in --out: drop predictions another model, routers, dtype, "
                      "implementation or setting made there (default: refuse to mix them)")
  p.add_argument("--dtype", default=dtype_default)
  p.add_argument("--impl", default="auto", help="attention implementation (default auto)")
  from elastic_jax.attention.reference import SETTINGS
  p.add_argument("--setting", choices=SETTINGS,
                 help="what full and sparse heads run (default: the routers' setting, else "
                      "fa-ssa); xa = XAttention's content-chosen blocks")
  p.add_argument("--xa-threshold", type=float, help="XAttention's mass threshold (default 0.9)")
  p.add_argument("--batch-size", type=_positive_int, default=1)
  p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                 help="wrap prompts in the tokenizer's chat template (auto: when it has one)")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("ruler", help="RULER synthetic tasks, generated locally")
  _common(r)
  r.add_argument("--lengths", default="4096", type=_int_list,
                 help="comma-separated context lengths (tokens)")
  r.add_argument("--tasks", default="niah_single_1,niah_multikey_1,vt,cwe")
  r.add_argument("--samples", type=_positive_int, default=4, help="samples per task and length")
  r.add_argument("--seed", type=int, default=0)
  mx = sub.add_parser("mixture", help="the reproduction's synthetic task mixture "
                      "(elastic_jax/repro/mixture.py), seen and held-out variants")
  _common(mx, model_default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "elastic_jax", "repro", "backbone"),
          dtype_default="float32")     # a 2.6M-parameter model: float32 costs nothing
  mx.add_argument("--lengths", default="384", type=_int_list,
                  help="prompt lengths (tokens) of the seen variant: training templates")
  mx.add_argument("--heldout-lengths", default="896", type=_int_list,
                  help="prompt lengths of the held-out variant: the held-out template")
  mx.add_argument("--tasks", default="kv,hop,summary,pattern,fewshot")
  mx.add_argument("--samples", type=_positive_int, default=8,
                  help="samples per task, variant and length")
  mx.add_argument("--seed", type=int, default=0)
  for name in ("longbench", "longbench-v2"):
    lb = sub.add_parser(name, help=f"{name} from local files")
    _common(lb)
    lb.add_argument("--data", required=True, help="directory holding the published files")
    lb.add_argument("--limit", type=_positive_int, help="at most this many records per dataset")
    lb.add_argument("--max-length", type=_positive_int, default=None,
                    help="prompt tokens kept (middle truncation; default LongBench's 31500, "
                         "120000 for v2, capped by the model)")
    if name == "longbench":
      lb.add_argument("--datasets", help="comma-separated datasets (default: all)")
      lb.add_argument("--e", action="store_true", help="LongBench-E (*_e.jsonl), by length")
  pp = sub.add_parser("ppl", help="next-token loss and perplexity of a text, full attention")
  pp.add_argument("--model", required=True)
  src = pp.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="UTF-8 text file, tokenized with DIR's tokenizer")
  src.add_argument("--ids", help="JSON file holding a list of token ids")
  pp.add_argument("--dtype", default="bfloat16")
  pp.add_argument("--max-tokens", type=_positive_int, default=4096)
  return p.parse_args(argv)


def _csv(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def _load(args):
  """(model with its router config, routers or None, tokenizer). The routers are --routers,
  else those the model directory holds (the authors' released models carry theirs)."""
  import elastic_jax as ej
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.train.data import load_tokenizer
  model = ej.from_pretrained(args.model, dtype=args.dtype, show_progress=False,
                             routers=args.routers)
  tokenizer = load_tokenizer(args.model)
  routers = model.router_params
  if routers is not None and not args.routers:
    print(f"routers: the model directory's own ({model.router_config.setting}, sink "
          f"{model.router_config.sink_blocks} + window {model.router_config.local_blocks} "
          f"blocks of {model.router_config.block})", flush=True)
  changes = {k: v for k, v in (("setting", args.setting), ("xa_threshold", args.xa_threshold))
             if v is not None}
  if changes:
    try:
      rcfg = dataclasses.replace(model.router_config, **changes)
    except ValueError as e:
      raise ElasticJaxError(str(e)) from None
    model = dataclasses.replace(model, router_config=rcfg)
  return model, routers, tokenizer


def _settings(args, routers) -> list[str]:
  if args.attention:
    return _csv(args.attention)
  if routers is None:
    return ["full", "sparse"]
  return ["full", "elastic", "sparse", "static"] if args.command == "mixture" else [
      "full", "elastic", "static"]


def _chat(args):
  return {"auto": None, "on": True, "off": False}[args.chat]


def ruler_items(args, tokenizer, max_positions: int):
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.eval import ruler
  from elastic_jax.eval.longbench import apply_chat_template, input_ids
  from elastic_jax.eval.runner import Item
  lengths = [int(x) for x in _csv(args.lengths)]
  if any(n > max_positions for n in lengths):
    raise ElasticJaxError(f"--lengths {args.lengths}: the model holds at most {max_positions} "
                          "positions")
  chat = _chat(args)
  use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
  items, samples = [], {}
  for task in _csv(args.tasks):
    for n in lengths:
      for s in ruler.generate(task, tokenizer, n, args.samples, seed=args.seed):
        text = apply_chat_template(s.input, tokenizer) if use_chat else s.input
        text += s.answer_prefix
        key = f"{task}/{n}/{s.index}"
        items.append(Item(key, f"{task}@{n}", tuple(input_ids(text, tokenizer, use_chat)),
                          s.max_new_tokens))
        samples[key] = s
  return items, samples


def ruler_score(samples):
  from elastic_jax.eval import ruler

  def score(task_at_len, predictions, items):
    task = task_at_len.split("@")[0]
    return ruler.score(task, predictions, [samples[it.key] for it in items])
  return score


def ruler_category(task_at_len: str) -> str:
  task = task_at_len.split("@")[0]
  return ("retrieval (NIAH)" if task.startswith("niah") else
          "multi-hop tracing" if task == "vt" else "aggregation")


def mixture_items(args, tokenizer, max_positions: int):
  """Items of the task mixture: every task at each seen length (training templates, alternating)
  and held-out length (the held-out template); prompts are <bos> context question."""
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.eval.runner import Item
  from elastic_jax.repro import mixture
  mixture.check_tokenizer(tokenizer, args.model)
  variants = [("seen", mixture.TRAIN_TEMPLATES, [int(x) for x in _csv(args.lengths)]),
              ("held-out", (mixture.HELDOUT_TEMPLATE,),
               [int(x) for x in _csv(args.heldout_lengths)])]
  items, answers = [], {}
  for t, task in enumerate(_csv(args.tasks)):
    if task not in mixture.TASKS:
      raise ElasticJaxError(f"--tasks: '{task}' is unknown (known: {', '.join(mixture.TASKS)})")
    for v, (variant, templates, lengths) in enumerate(variants):
      for n in lengths:
        if not 16 <= n <= max_positions - 64:
          raise ElasticJaxError(f"length {n}: must lie in [16, {max_positions - 64}] for this "
                                "model")
        rng = np.random.default_rng([args.seed, t, v, n])
        for i in range(args.samples):
          s = mixture.make_sample(task, rng, n, templates[i % len(templates)])
          key = f"{task}/{variant}/{n}/{i}"
          ids = (mixture.BOS, *map(int, s.context), *map(int, s.question))
          items.append(Item(key, f"{task}@{variant}", ids, len(s.answer) + 1))
          answers[key] = mixture.decode(s.answer)
  return items, answers


def mixture_score(answers):
  def score(task, predictions, items):
    return 100.0 * float(np.mean([p.split() == answers[it.key].split()
                                  for p, it in zip(predictions, items)]))
  return score


def mixture_category(task_at_variant: str) -> str:
  from elastic_jax.repro import mixture
  return mixture.TASK_TYPE[task_at_variant.split("@")[0]]


def longbench_items(args, tokenizer, max_positions: int, v2: bool):
  from elastic_jax.eval import longbench as lb
  from elastic_jax.eval.metrics import longbench_e_bucket
  from elastic_jax.eval.runner import Item
  if v2:
    records = lb.load_longbench_v2(args.data, limit=args.limit)
  else:
    records = lb.load_longbench(args.data, _csv(args.datasets) if args.datasets else None,
                                e=args.e, limit=args.limit)
  default = lb.V2_DEFAULT_MAX_LENGTH if v2 else lb.V1_MAX_LENGTH
  items, by_key = [], {}
  for rec in records:
    max_new = lb.V2_MAX_NEW_TOKENS if v2 else lb.MAX_NEW_TOKENS[rec.dataset]
    max_len = min(args.max_length or default, max_positions - max_new)
    text, max_new, apply_chat = lb.model_input(rec, tokenizer, max_len, _chat(args))
    key = f"{'longbench-v2' if v2 else rec.dataset}/{rec.id}"
    # LongBench-E is reported per dataset and length bucket (0-4k, 4-8k, 8k+), as published.
    task = (f"{rec.difficulty}/{rec.length}" if v2 else
            f"{rec.dataset}@{longbench_e_bucket(rec.length)}" if rec.e else rec.dataset)
    items.append(Item(key, task,
                      tuple(lb.input_ids(text, tokenizer, apply_chat)), max_new,
                      tuple(lb.extra_stop_ids(rec, tokenizer))))
    by_key[key] = rec
  return items, by_key


def longbench_score(by_key, v2: bool):
  from elastic_jax.eval import metrics

  def score(task, predictions, items):
    recs = [by_key[it.key] for it in items]
    if v2:
      return metrics.score_longbench_v2(
          [{"difficulty": r.difficulty, "length": r.length, "answer": r.answer} for r in recs],
          predictions)["overall"]
    return metrics.score_longbench(recs[0].dataset, predictions,
                                   [list(r.answers) for r in recs], recs[0].all_classes)
  return score


def _files_digest(root: str, names) -> str:
  """sha256 of (name, size, mtime) of each file: which weights, without reading them."""
  import hashlib
  h = hashlib.sha256()
  for name in sorted(names):
    st = os.stat(os.path.join(root, name))
    h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:16]


def provenance(args, model) -> dict:
  """What produced predictions: reused on a rerun only if all of it is the same."""
  import hashlib
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
  return {"setting": rcfg.setting,
          **({"xa_threshold": rcfg.xa_threshold} if rcfg.uses_xattention else {}),
          "model": root, "weights": _files_digest(root, weights), "routers": routers,
          "dtype": args.dtype, "impl": args.impl, "chat": args.chat,
          "seed": getattr(args, "seed", None)}


def _check_provenance(out: str, record: dict, overwrite: bool) -> None:
  """Predictions in `out` are reused on a rerun only if the same model, weights, routers,
  dtype, implementation, head setting, chat mode and seed made them (setting.json)."""
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.utils import atomic_write_text
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
      raise ElasticJaxError(f"{out} holds predictions made with {k} {before.get(k, '(not recorded)')!r}, "
                            f"not {record[k]!r}: pass another --out, or --overwrite to start "
                            "over there")
    return
  if overwrite:
    for name in ("predictions.jsonl", "setting.json", "report.json", "report.md"):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, name))
  os.makedirs(out, exist_ok=True)
  atomic_write_text(path, json.dumps(record) + "\n")


def _check_out(out: str, args) -> None:
  from elastic_jax.errors import ElasticJaxError
  from elastic_jax.utils import check_apart
  if os.path.exists(out) and not os.path.isdir(out):
    raise ElasticJaxError(f"--out {out}: is a file, not a directory")
  check_apart(out, [args.model, getattr(args, "routers", None), getattr(args, "data", None)],
              "an input (--model, --routers or --data)")


def run_benchmark(args) -> int:
  from elastic_jax.eval import metrics, report, runner
  if args.out:
    _check_out(args.out, args)
  model, routers, tokenizer = _load(args)
  settings = _settings(args, routers)
  runner.check_settings(settings, routers)
  max_positions = model.config.max_length
  if args.command == "ruler":
    items, samples = ruler_items(args, tokenizer, max_positions)
    score, category = ruler_score(samples), ruler_category
  elif args.command == "mixture":
    items, answers = mixture_items(args, tokenizer, max_positions)
    score, category = mixture_score(answers), mixture_category
  else:
    v2 = args.command == "longbench-v2"
    items, by_key = longbench_items(args, tokenizer, max_positions, v2)
    score = longbench_score(by_key, v2)
    category = ((lambda t: "LongBench-v2") if v2
                else (lambda t: metrics.DATASET_CATEGORY[t.split("@")[0]]))
  rcfg = model.router_config
  setting = {"setting": rcfg.setting,
             **({"xa_threshold": rcfg.xa_threshold} if rcfg.uses_xattention else {})}
  out = args.out or os.path.join(
      "runs", f"eval_{args.command.replace('-', '_')}"
      + ("" if rcfg.setting == "fa-ssa" else f"_{rcfg.setting}"))
  _check_provenance(out, provenance(args, model), args.overwrite)
  t0 = time.perf_counter()
  records = runner.run(model, tokenizer, items, settings, out, router_params=routers,
                       batch_size=args.batch_size, attn_impl=args.impl)
  summary = report.summarize(records, items, score, category)
  import jax
  meta = {"benchmark": args.command, "model": os.path.basename(os.path.normpath(args.model)),
          "settings_requested": settings, "device": jax.devices()[0].device_kind,
          "date": time.strftime("%Y-%m-%d"), "items": len(items), **setting}
  paths = report.write(summary, records, out, f"{args.command}: {meta['model']}", meta)
  print(open(os.path.join(out, "report.md"), encoding="utf-8").read())
  print(f"wrote {', '.join(paths)} ({time.perf_counter() - t0:.0f} s)")
  return 0


def perplexity(args) -> int:
  import jax
  import elastic_jax as ej
  from elastic_jax.errors import ElasticJaxError
  model = ej.from_pretrained(args.model, dtype=args.dtype)
  try:
    if args.ids:
      with open(args.ids) as f:
        raw = json.load(f)
      if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in raw):
        raise ElasticJaxError(f"--ids {args.ids}: must hold a JSON list of token ids")
      ids = np.asarray(raw, dtype=np.int64)
    else:
      from elastic_jax.train.data import load_tokenizer
      with open(args.text, encoding="utf-8") as f:
        text = f.read()
      ids = np.asarray(load_tokenizer(args.model)(text)["input_ids"], dtype=np.int64)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    raise ElasticJaxError(f"cannot read the evaluation input ({e})") from None
  ids = ids[: args.max_tokens]
  if ids.ndim != 1 or ids.size < 2:
    raise ElasticJaxError("the evaluation input needs at least two tokens")
  t0 = time.perf_counter()
  logits = model.logits(ids)[0, :-1]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -np.asarray(logp)[np.arange(ids.size - 1), ids[1:]]
  dt = time.perf_counter() - t0
  print(json.dumps({"tokens": int(ids.size), "mean_nll": float(nll.mean()),
                    "perplexity": float(np.exp(nll.mean())), "seconds": round(dt, 3),
                    "dtype": model.dtype}))
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.command == "ppl":
    return perplexity(args)
  return run_benchmark(args)


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
