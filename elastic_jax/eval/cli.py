"""The evaluation command (`eval.py`, `elastic-jax-eval`): parse, build, call.

    eval.py {ruler,longbench,longbench-v2,mixture,ppl} [options]

A benchmark (eval/benchmarks.py) makes the items; the runner (eval/runner.py) generates under
each way of attending (heads.ATTENTION) and keeps predictions.jsonl; the report
(eval/report.py) scores, writes report.json / report.md and plots. An output directory is
reused only for predictions the same model, weights, routers, dtype, implementation, pattern
pair, chat mode and seed made (setting.json; --overwrite starts over), and by one run at a
time (a second is refused while the first runs: `files.DirectoryLock`). --print-config prints
a subcommand's resolved settings as YAML, which --config FILE reads back.
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
sparse, most-chosen, static-gate; default full,elastic,most-chosen with routers, else
full,sparse; the old name `static` still means most-chosen). --static-routers S (a trained
static router, train.py with router.static=true) adds static-gate: S's heads ranked by their
logit margin, as many full as elastic's average, and the report puts elastic beside it and
beside its most-chosen heads, paired over the same items. The output
directory gets predictions.jsonl (resumable), report.json, report.md (the paper's Table 1
layout) and PNG plots. LongBench data: the published JSONL files of THUDM/LongBench
(data/*.jsonl; LongBench-E: *_e.jsonl) or LongBench-v2's data.json, in --data.
"""
PROVENANCE_VERSION = 2


DTYPE_HELP = ("parameter dtype: auto (default: the checkpoint's own dtype, as transformers "
              "loads it), bfloat16, float32 or float16")


def _common(p: argparse.ArgumentParser, benchmark) -> None:
  default = benchmark.model_default
  p.add_argument("--model", required=default is None, default=None,
                 help="model directory (with tokenizer files)"
                 + ("; default: the shipped backbone" if default else ""))
  p.add_argument("--routers", help="router export directory (train.py's export/elastic_jax); "
                                   "default: the model directory's own routers, if any")
  p.add_argument("--static-routers",
                 help="a trained static router's export (train.py with router.static=true): "
                      "adds static-gate, its heads at elastic's average MSR")
  p.add_argument("--attention", help="comma-separated ways heads attend: full, elastic, "
                                     "sparse, most-chosen (elastic's most-chosen heads), "
                                     "static-gate (--static-routers' heads)")
  p.add_argument("--out", help="output directory (default runs/eval_<benchmark>); one run at a "
                               "time writes there (a second is refused while the first runs)")
  p.add_argument("--overwrite", action="store_true",
                 help="start over in --out: drop predictions another model, routers, dtype, "
                      "implementation or pattern pair made there (default: refuse to mix them)")
  p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
  p.add_argument("--attn-impl", default="auto", help="attention implementation (default auto)")
  from elastic_jax.attention.patterns import PATTERN_PAIRS
  p.add_argument("--patterns", choices=PATTERN_PAIRS,
                 help="the pattern pair, what full- and sparse-routed heads run (default: the "
                      "routers', else fa-ssa); xa = XAttention's content-chosen blocks")
  p.add_argument("--xa-threshold", type=float, help="XAttention's mass threshold (default 0.9)")
  p.add_argument("--batch-size", type=positive_int, default=1,
                 help="prompts generated together (default 1)")
  p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                 help="wrap prompts in the tokenizer's chat template (auto: when it has one)")


def _config_options(p: argparse.ArgumentParser, prog: str, command: str) -> None:
  p.add_argument("--config", metavar="FILE",
                 help="YAML file of this command's settings, what --print-config prints (keys "
                      "are the options' names, e.g. batch_size: 8; paths are relative to the "
                      "working directory); options given on the command line win; "
                      "configs/NAME.yaml names a shipped file where no such file is")
  p.add_argument("--print-config", action="store_true",
                 help=f"print the resolved settings of {prog} {command} as YAML (what --config "
                      f"reads back), then stop")


def build_parser() -> argparse.ArgumentParser:
  from elastic_jax.cli import prog_name, with_prog
  prog = prog_name("eval.py")
  p = argparse.ArgumentParser(prog=prog, description=with_prog(USAGE, "eval.py", prog),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True, metavar="BENCHMARK",
                         help="what to evaluate (BENCHMARK --help lists its options)")
  for name, benchmark in BENCHMARKS.items():
    b = sub.add_parser(name, help=benchmark.help)
    _common(b, benchmark)
    benchmark.add_arguments(b)
    _config_options(b, prog, name)
  pp = sub.add_parser("ppl", help="next-token loss and perplexity of a text, full attention")
  pp.add_argument("--model", required=True, help="model directory (with tokenizer files for "
                                                 "--text)")
  src = pp.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="UTF-8 text file, tokenized with DIR's tokenizer")
  src.add_argument("--ids", help="JSON file holding a list of token ids")
  pp.add_argument("--dtype", default="auto", help=DTYPE_HELP)
  pp.add_argument("--max-tokens", type=positive_int, default=4096,
                  help="tokens scored, from the start of the input (default 4096)")
  _config_options(pp, prog, "ppl")
  return p


# ----------------------------------------------------------------------------------------------
# Settings files (--config, --print-config)

_NOT_SETTINGS = ("help", "config", "print_config")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  """{subcommand: its parser}."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      return dict(action.choices)
  return {}


def _settings(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
  """The options of a subcommand that are settings (not --help, --config, --print-config)."""
  return {a.dest: a for a in sub._actions
          if a.dest not in _NOT_SETTINGS and a.dest != argparse.SUPPRESS}


def _config_value(action: argparse.Action, value, where: str):
  """A settings file's value for `action`, checked as the command line would check it."""
  if value is None:
    return None
  if isinstance(action, argparse._StoreTrueAction):
    if not isinstance(value, bool):
      raise ElasticJaxError(f"{where} should be true or false, got {value!r}")
    return value
  if isinstance(value, (bool, dict, set)):
    raise ElasticJaxError(f"{where} should be a text, a number or a list, as the command line "
                          f"takes it, got {value!r}")
  if isinstance(value, (list, tuple)):
    if not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in value):
      raise ElasticJaxError(f"{where} should be a list of plain values, got {value!r}")
    value = ",".join(str(x) for x in value)
  text = value if isinstance(value, str) else str(value)
  if action.type is not None:
    try:
      value = action.type(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
      raise ElasticJaxError(f"{where}: {e}") from None
  else:
    value = text
  if action.choices is not None and value not in action.choices:
    raise ElasticJaxError(f"{where} should be one of {', '.join(map(str, action.choices))}, got "
                          f"{value!r}")
  return value


def read_settings(path: str, command: str, sub: argparse.ArgumentParser) -> dict:
  """{dest: value} of an eval settings file (`--print-config`'s YAML) for `command`."""
  import yaml
  from elastic_jax.cli import config_file
  path = config_file(path, "settings file")
  try:
    with open(path, encoding="utf-8") as f:
      raw = yaml.safe_load(f)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    raise ElasticJaxError(f"{path}: not valid YAML{where}") from None
  except (UnicodeDecodeError, IsADirectoryError):
    raise ElasticJaxError(f"{path}: not a UTF-8 text file") from None
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ElasticJaxError(f"{path}: the top level should be a mapping of settings, got "
                          f"{type(raw).__name__}")
  actions = _settings(sub)
  values = {}
  for key, value in raw.items():
    name = str(key).replace("-", "_")
    if name == "command":
      if value != command:
        raise ElasticJaxError(f"{path}: holds the settings of '{value}', not of '{command}'")
      continue
    if name not in actions:
      import difflib
      close = difflib.get_close_matches(name, list(actions), n=1)
      hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(actions)}"
      raise ElasticJaxError(f"{path}: '{key}' is not a setting of {command} ({hint})")
    if value is None and actions[name].required:
      continue                                   # not set: the command line must give it
    values[name] = _config_value(actions[name], value, f"{path}: '{key}'")
  return values


def _given(argv, action: argparse.Action) -> bool:
  """Whether the command line names `action` (or an abbreviation of its option)."""
  for arg in argv:
    flag = arg.split("=", 1)[0]
    if flag.startswith("--") and len(flag) > 2 and any(
        opt.startswith(flag) for opt in action.option_strings):
      return True
  return False


def parse(argv=None) -> argparse.Namespace:
  """The command line, with the settings of --config under it (the command line wins)."""
  import sys
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  subs = _subparsers(parser)
  command = next((a for a in argv if a in subs), None)
  if command is None:
    return parser.parse_args(argv)               # argparse says what is missing
  sub = subs[command]
  rest = argv[argv.index(command) + 1:]
  config = None
  for i, arg in enumerate(rest):
    if arg == "--config" and i + 1 < len(rest):
      config = rest[i + 1]
    elif arg.startswith("--config="):
      config = arg.split("=", 1)[1]
  values = read_settings(config, command, sub) if config else {}
  printing = "--print-config" in rest
  actions = _settings(sub)
  for dest, value in values.items():
    sub.set_defaults(**{dest: value})
    if value is not None:
      actions[dest].required = False
  for group in sub._mutually_exclusive_groups:
    given = [a for a in group._group_actions if values.get(a.dest) is not None]
    if len(given) > 1:
      on_line = [a for a in given if _given(rest, a)]
      if not on_line:
        raise ElasticJaxError(f"{config}: {' and '.join(a.dest for a in given)} exclude each "
                              "other; give one")
    if given or printing:
      group.required = False
  if printing:
    for action in actions.values():
      action.required = False
  args = parser.parse_args(argv)
  for group in sub._mutually_exclusive_groups:     # the command line's choice wins
    members = group._group_actions
    if any(_given(rest, a) for a in members):
      for a in members:
        if not _given(rest, a) and a.dest in values:
          setattr(args, a.dest, None)
  return args


def describe_settings(args) -> str:
  """The resolved settings of a subcommand as YAML that --config reads back."""
  import yaml
  from elastic_jax.cli import prog_name
  sub = _subparsers(build_parser())[args.command]
  settings = {"command": args.command}
  settings.update({dest: getattr(args, dest) for dest in _settings(sub)})
  prog = prog_name("eval.py")
  return (f"# The resolved settings of {prog} {args.command}; {prog} {args.command} --config "
          f"FILE reads them back.\n"
          + yaml.safe_dump(settings, sort_keys=False, default_flow_style=False, width=10**6,
                           allow_unicode=True))


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
          "dtype": model.dtype, "attn_impl": args.attn_impl, "chat": args.chat,
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
  """An output directory apart from the inputs, that is or can be made a writable directory."""
  from elastic_jax.files import check_apart, check_creatable
  if os.path.exists(out) and not os.path.isdir(out):
    raise ElasticJaxError(f"--out {out}: is a file, not a directory")
  check_apart(out, [args.model, getattr(args, "routers", None), getattr(args, "data", None),
                   getattr(args, "static_routers", None)],
              "an input (--model, --routers, --static-routers or --data)")
  check_creatable(out, "--out")


# ----------------------------------------------------------------------------------------------
# Running


def default_attention(args, has_routers: bool) -> list[str]:
  if args.attention:
    return csv(args.attention)
  if not has_routers:
    return ["full", "sparse"]
  ways = (["full", "elastic", "sparse", "most-chosen"] if args.command == "mixture"
          else ["full", "elastic", "most-chosen"])
  return ways + (["static-gate"] if getattr(args, "static_routers", None) else [])


def static_margin(args, model):
  """[L, K] the ranking of --static-routers' heads (router.static_margin), or None; refused
  in one sentence when they are no static router or do not fit the model."""
  path = getattr(args, "static_routers", None)
  if not path:
    return None
  from elastic_jax import router_io
  from elastic_jax.router import static_margin as margin
  r = router_io.load_routers(path)
  if not r.config.static:
    raise ElasticJaxError(f"--static-routers {path}: input-dependent routers, not a static "
                          "router (train.py with router.static=true)")
  m = np.asarray(margin(r.params["static_logits"]))
  want = (model.config.num_layers, model.config.num_kv_heads)
  if m.shape != want:
    raise ElasticJaxError(f"--static-routers {path}: gates for {m.shape[0]} layers x "
                          f"{m.shape[1]} KV heads, the model has {want[0]} x {want[1]}")
  return m


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
  margin = static_margin(args, model)
  attention = runner.check_attention_list(attention, model.router_params, margin)
  items = benchmark.items(args, tokenizer, model.config.max_length)
  rcfg = model.router_config
  note_window_covers_prompts(rcfg, attention, items)
  out = args.out or os.path.join(
      "runs", f"eval_{args.command.replace('-', '_')}"
      + ("" if rcfg.patterns == "fa-ssa" else f"_{rcfg.patterns}"))
  if not args.out:
    check_out(out, args)
  from elastic_jax.files import DirectoryLock
  # One run at a time per output directory: a second (or an --overwrite run started beside
  # the first) is refused before it reads or removes anything there.
  with DirectoryLock(out, "eval output directory") as lock:
    if lock.taken_over:
      print(f"note: {out} was locked by {lock.taken_over}, which has ended; continuing",
            flush=True)
    record = provenance(args, model)
    if margin is not None:   # recorded only when given: runs before it stay readable
      record["static_routers"] = hashlib.sha256(margin.tobytes()).hexdigest()[:16]
    check_provenance(out, record, args.overwrite)
    t0 = time.perf_counter()
    records = runner.run(model, tokenizer, items, attention, out, batch_size=args.batch_size,
                         attn_impl=args.attn_impl, static_margin=margin)
    summary = report.summarize(records, items, benchmark.score, benchmark.category)
    name = os.path.basename(os.path.normpath(args.model))
    meta = {"benchmark": args.command, "model": name, "attention_requested": attention,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "items": len(items), "patterns": rcfg.patterns,
            **({"routers": os.path.normpath(args.routers)} if args.routers else {}),
            **({"static_routers": os.path.normpath(args.static_routers)}
               if margin is not None else {}),
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
  args = parse(argv)
  if args.print_config:
    if args.command != "ppl" and BENCHMARKS[args.command].model_default is not None:
      resolve_model(args, BENCHMARKS[args.command])
    print(describe_settings(args), end="")
    return 0
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
