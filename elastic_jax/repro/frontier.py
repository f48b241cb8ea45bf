"""The accuracy-sparsity frontier of the reproduction: router trainings, static head sets and
their teacher-forced evaluation (docs/results.md).

  python -m elastic_jax.repro.frontier train PLAN.yaml --out runs/sweep [--parallel 4]
  python -m elastic_jax.repro.frontier heads --out runs/heads.json [--samples 64]
  python -m elastic_jax.repro.frontier score runs/sweep --out runs/scores.json \\
      [--heads runs/heads.json] [--seed 1 --samples 200]
  python -m elastic_jax.repro.frontier report runs/scores.json [--plot frontier.png]
  python -m elastic_jax.repro.frontier training docs/records/router_training.json --runs A,B \\
      --plot training.png

`train` runs the plan's router trainings (train.py, one process each, --parallel at a time on
one device). A plan is YAML:

  config: mixture.yaml                  # the shipped config (or a path) every run starts from
  common: [data.train_path=..., ...]    # overrides of every run
  runs:
    NAME: [override, ...]               # an elastic run (or any other train.py run)
    NAME2: {static_of: NAME, overrides: [router.static=true, train.lr=2e-2]}
    NAME3: {recipe: prulong, static_of: NAME}   # or duo: the paper's baselines (baselines.py)

A run with `static_of` starts once NAME has finished, with every target at NAME's average
held-out MSR (its eval.json): the trained static gate at elastic's budget (PruLong: its
target share of streaming heads).

`heads` finds, per task, the smallest head set that keeps accuracy within --tolerance of full
attention (greedy backward ablation over (layer, KV head) pairs, scoring.minimal_head_set),
and the ablation order over the sensitive tasks together, whose first n heads give the best
static set of every size that greedy ablation finds (an oracle: it is chosen on the tasks).

`score` evaluates, on the same items (eval.py mixture's, --seed and --samples; teacher-forced,
scoring.py), full attention, every head streaming, each task's minimal set and a router that
knows each item's task (with --heads), each trained run's routers, and for each elastic run
the static head sets at exactly its average MSR (scoring.static_at): its most often chosen
heads, every static run's gate ranked by its logit margin (train.py's static gates,
DuoAttention's, PruLong's), and the greedy oracle. Per-item results go to --out.

`report` prints the frontier's tables (elastic against each static baseline, paired over the
same items, with 95% intervals) and plots accuracy against average MSR (frontier_report.py);
`training` plots the saturated routing decisions and the robust tasks' MSR over training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from elastic_jax.errors import ElasticJaxError



# ----------------------------------------------------------------------------------------------
# train


# How a plan's run is trained: train.py (elastic routers or router.static gates), or one of
# the paper's static baselines (repro/baselines.py).
RECIPES = ("train", "duo", "prulong")


def read_plan(path: str) -> dict:
  """The plan, checked: {"config", "common", "runs": {name: {"overrides", "static_of"}}}."""
  import yaml
  try:
    with open(path, encoding="utf-8") as f:
      raw = yaml.safe_load(f)
  except (OSError, yaml.YAMLError) as e:
    raise ElasticJaxError(f"{path}: cannot read the plan ({type(e).__name__})") from None
  if not isinstance(raw, dict) or not isinstance(raw.get("runs"), dict) or not raw["runs"]:
    raise ElasticJaxError(f"{path}: a plan is a mapping with a non-empty 'runs' mapping")
  unknown = set(raw) - {"config", "common", "runs"}
  if unknown:
    raise ElasticJaxError(f"{path}: unknown plan keys {sorted(unknown)} (config, common, runs)")
  runs = {}
  for name, spec in raw["runs"].items():
    if not isinstance(name, str) or not name.replace("-", "").replace("_", "").replace(
        ".", "").isalnum():
      raise ElasticJaxError(f"{path}: run name {name!r} must be letters, digits, '-', '_', '.'")
    if isinstance(spec, list) or spec is None:
      spec = {"overrides": spec or []}
    if not isinstance(spec, dict) or set(spec) - {"overrides", "static_of", "recipe"}:
      raise ElasticJaxError(f"{path}: run {name}: a list of overrides or a mapping with "
                            "overrides, static_of and recipe")
    spec = {"overrides": [str(x) for x in spec.get("overrides") or []],
            "static_of": spec.get("static_of"), "recipe": spec.get("recipe", "train")}
    if spec["recipe"] not in RECIPES:
      raise ElasticJaxError(f"{path}: run {name}: recipe '{spec['recipe']}' is unknown "
                            f"({', '.join(RECIPES)})")
    if spec["static_of"] is not None and spec["static_of"] not in raw["runs"]:
      raise ElasticJaxError(f"{path}: run {name}: static_of names no run of the plan "
                            f"({spec['static_of']})")
    runs[name] = spec
  return {"config": str(raw.get("config") or "mixture.yaml"),
          "common": [str(x) for x in raw.get("common") or []], "runs": runs}


def average_msr(run_dir: str) -> float:
  """The mean over task types of a run's held-out MSR (its eval.json)."""
  path = os.path.join(run_dir, "eval.json")
  try:
    with open(path, encoding="utf-8") as f:
      m = json.load(f)["msr_task"]
  except (OSError, ValueError, KeyError) as e:
    raise ElasticJaxError(f"{path}: no held-out MSR ({type(e).__name__})") from None
  return round(float(np.mean(list(m.values()))), 4)


def train(args) -> int:
  plan = read_plan(args.plan)
  os.makedirs(args.out, exist_ok=True)
  pending = dict(plan["runs"])
  running: dict[str, tuple[subprocess.Popen, float]] = {}
  status: dict[str, dict] = {}
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / args.parallel:.3f}",
             PYTHONUNBUFFERED="1")
  t0 = time.time()

  def start(name, spec):
    run_dir = os.path.join(args.out, name)
    extra = []
    if spec["static_of"]:
      m = average_msr(os.path.join(args.out, spec["static_of"]))
      extra = ([f"objective.targets=[{m},{m},{m},{m},{m}]"] if spec["recipe"] != "prulong"
               else ["--target", str(m)])
    entry = (["-c", "from elastic_jax.train.cli import console; console()"]
             if spec["recipe"] == "train" else
             ["-m", "elastic_jax.repro.baselines", spec["recipe"]])
    cmd = [sys.executable, *entry, "--config", plan["config"],
           *plan["common"], *spec["overrides"], *extra, f"run_dir={run_dir}"]
    log = open(os.path.join(args.out, f"{name}.log"), "w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      cwd=args.cwd or None), time.time())
    print(f"[{time.time() - t0:6.0f}s] started {name}", flush=True)

  while pending or running:
    for name, spec in list(pending.items()):
      if len(running) >= args.parallel:
        break
      dep = spec["static_of"]
      if dep and dep not in status:
        continue
      del pending[name]
      if dep and status[dep]["rc"] != 0:
        status[name] = {"rc": -1, "seconds": 0, "why": f"{dep} failed"}
        continue
      start(name, spec)
    time.sleep(1)
    for name, (proc, started) in list(running.items()):
      rc = proc.poll()
      if rc is None:
        continue
      del running[name]
      status[name] = {"rc": rc, "seconds": round(time.time() - started, 1)}
      done = len(status)
      total = done + len(pending) + len(running)
      rate = (time.time() - t0) / done
      print(f"[{time.time() - t0:6.0f}s] {name}: exit {rc} after {status[name]['seconds']}s "
            f"({done}/{total}; about {rate * (total - done) / max(args.parallel, 1):.0f}s "
            "left)", flush=True)
      with open(os.path.join(args.out, "train_status.json"), "w") as f:
        json.dump(status, f, indent=1)
  failed = [n for n, s in status.items() if s["rc"] != 0]
  if failed:
    print(f"failed: {', '.join(failed)} (see their logs in {args.out})", file=sys.stderr)
  return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# heads and score


def _load(args):
  """The backbone and a scorer whose streaming heads follow --config's router section (full,
  sparse and forced head sets; elastic runs use their routers' own)."""
  import elastic_jax as ej
  from elastic_jax.repro.scoring import Scorer
  from elastic_jax.train.cli import config_path
  from elastic_jax.train.run_config import load_run_config
  rcfg = load_run_config(config_path(args.config)).router
  model = ej.from_pretrained(args.model, dtype=args.dtype)
  return model, Scorer(model.params, model.config, rcfg, attn_impl=args.attn_impl,
                       rows=args.rows)


def heads(args) -> int:
  from elastic_jax.eval import mixture
  from elastic_jax.repro.scoring import eval_items, minimal_head_set
  out = {"seed": args.seed, "samples": args.samples, "tolerance": args.tolerance,
         "lengths": args.lengths, "tasks": {}}
  done = _earlier_heads(args.out, out) if args.keep else {}     # refused before the model loads
  model, scorer = _load(args)
  out["tasks"].update(done)
  t0 = time.time()
  tasks = args.tasks.split(",")
  for task in tasks:
    if task in done:
      print(f"{task}: kept from {args.out} ({done[task]['size']} heads)", flush=True)
      continue
    items = eval_items(args.seed, args.samples, (task,), (args.lengths,), (args.lengths,))
    items = [it for it in items if it.variant == "seen"] if args.seen_only else items
    print(f"[{time.time() - t0:5.0f}s] {task}: greedy ablation over {len(items)} items",
          flush=True)
    r = minimal_head_set(scorer, items, tolerance=args.tolerance, log=print)
    out["tasks"][task] = {"gates": r["gates"].astype(int).tolist(), "full": r["full"],
                          "sparse": r["sparse"], "path": r["path"],
                          "size": int(r["gates"].sum())}
    print(f"[{time.time() - t0:5.0f}s] {task}: {int(r['gates'].sum())} heads full keep "
          f"{100 * (r['path'][-1][2] if r['path'] else r['full']):.1f}% (full "
          f"{100 * r['full']:.1f}%, none {100 * r['sparse']:.1f}%)", flush=True)
    _write_json(args.out, out)
  joint_tasks = [t for t in tasks if mixture.is_sensitive(t)]
  if joint_tasks:
    items = eval_items(args.seed, args.samples, joint_tasks, (args.lengths,), (args.lengths,))
    items = [it for it in items if it.variant == "seen"] if args.seen_only else items
    print(f"[{time.time() - t0:5.0f}s] joint ablation order over {', '.join(joint_tasks)}",
          flush=True)
    r = minimal_head_set(scorer, items, stop_at=1, log=print)
    out["joint"] = {"tasks": joint_tasks, "path": r["path"],
                    "last": r["gates"].astype(int).tolist()}
  _write_json(args.out, out)
  print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
  return 0


def _earlier_heads(path: str, settings: dict) -> dict:
  """The per-task sets of an earlier `heads` file at `path` made with the same settings
  (seed, samples, tolerance, lengths), so that a run stopped midway goes on where it was; {}
  where there is none. A file made with other settings is refused rather than mixed in."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      earlier = json.load(f)
    tasks = dict(earlier["tasks"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ElasticJaxError(f"--keep: {path} is not a heads file ({type(e).__name__})") from None
  differ = [k for k in ("seed", "samples", "tolerance", "lengths") if earlier.get(k) != settings[k]]
  if differ:
    raise ElasticJaxError(f"--keep: {path} was made with other {', '.join(differ)}; give "
                          "another --out or the same settings")
  return tasks


def joint_order(heads_json: dict, shape: tuple[int, int]) -> np.ndarray:
  """[L, K] scores from the joint ablation order: later removals (more needed) score higher."""
  score = np.zeros(shape)
  path = heads_json["joint"]["path"]
  for rank, (layer, head, *_rest) in enumerate(path):
    score[layer, head] = rank + 1
  for layer, head in np.argwhere(np.asarray(heads_json["joint"]["last"]) > 0):
    score[layer, head] = len(path) + 1
  return score


def _write_json(path: str, obj) -> None:
  """Written whole or not at all (a temporary file renamed), so a run stopped midway leaves
  the last complete version."""
  from elastic_jax.files import atomic_write_text
  atomic_write_text(path, json.dumps(obj))


def _bits(x) -> str:
  return "".join("1" if v else "0" for v in np.asarray(x).astype(bool).reshape(-1))


def _model_name(path: str) -> str:
  """The model as a record names it: the shipped backbone by its place in the package, any
  other by its folder's name."""
  from elastic_jax.resources import PACKAGE_DIR
  default = os.path.join(PACKAGE_DIR, "repro", "backbone")
  if os.path.abspath(path) == os.path.abspath(default):
    return "the shipped backbone (elastic_jax/repro/backbone)"
  return os.path.basename(os.path.normpath(path))


def score(args) -> int:
  from elastic_jax import router_io
  from elastic_jax.repro.scoring import Scorer, eval_items, static_at
  from elastic_jax.router import static_margin
  runs = {}
  for spec in args.runs:
    if "=" in spec:
      name, path = spec.split("=", 1)
      runs[name] = path
    elif os.path.isdir(spec):
      for name in sorted(os.listdir(spec)):
        path = os.path.join(spec, name, "export", "elastic_jax")
        if os.path.isdir(path):
          runs[name] = path
    else:
      raise ElasticJaxError(f"{spec}: neither a folder of runs nor NAME=ROUTER_DIR")
  if not runs:
    raise ElasticJaxError(f"no routers to score in {', '.join(args.runs)} (give folders of "
                          "runs, each run's routers in RUN/export/elastic_jax, or NAME=DIR)")
  loaded = {name: router_io.load_routers(path) for name, path in runs.items()}
  heads_json = None
  if args.heads:
    try:
      with open(args.heads, encoding="utf-8") as f:
        heads_json = json.load(f)
      heads_json["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ElasticJaxError(f"{args.heads}: not a heads file of `frontier heads` "
                            f"({type(e).__name__})") from None
  model, scorer = _load(args)
  cfg = model.config
  shape = (cfg.num_layers, cfg.num_kv_heads)
  tasks = tuple(args.tasks.split(","))
  items = eval_items(args.seed, args.samples, tasks, args.lengths_list, args.heldout_list,
                     wordings=args.wordings, evidence=args.evidence)
  results = {"items": [{"key": it.key, "task": it.task, "variant": it.variant} for it in items],
             "model": _model_name(args.model),
             "seed": args.seed, "samples": args.samples, "wordings": args.wordings,
             "evidence": args.evidence, "methods": {}}
  t0 = time.time()

  def record(name, res, **extra):
    msr = np.round(res["msr"].astype(float), 4)
    results["methods"][name] = {"correct": _bits(res["correct"]),
                                "msr": float(msr[0]) if np.all(msr == msr[0]) else msr.tolist(),
                                **extra}
    acc = {t: float(np.mean([c for c, it in zip(res["correct"], items) if it.task == t]))
           for t in tasks}
    print(f"[{time.time() - t0:5.0f}s] {name:<34} MSR {res['msr'].mean():.3f}  "
          + " ".join(f"{t} {100 * a:5.1f}" for t, a in acc.items()), flush=True)

  record("full", scorer.score(items, "full"))
  record("sparse", scorer.score(items, "sparse"))
  if heads_json:
    for task, body in heads_json["tasks"].items():
      g = np.asarray(body["gates"], np.float32)
      record(f"task-set/{task}", scorer.score(items, "forced", gates=g),
             gates=body["gates"])
    if all(t in heads_json["tasks"] for t in tasks):
      # A router that knows each item's task and gives it that task's minimal set: what
      # input-dependent routing could reach on this mixture.
      per_item = np.stack([np.asarray(heads_json["tasks"][it.task]["gates"], np.float32)
                           for it in items])
      record("task-oracle", scorer.score(items, "forced", gates=per_item))
  statics = {n: r for n, r in loaded.items() if r.config.static}
  for name, r in loaded.items():
    if r.config.static:
      continue
    sc = Scorer(model.params, cfg, r.config, attn_impl=args.attn_impl, rows=args.rows)
    res = sc.score(items, "elastic", routers=r.params)
    m = float(res["msr"].mean())
    freq = res["gates"].mean(0)
    record(f"{name}/elastic", res, frequency=np.round(freq, 4).tolist(),
           distinct={f"{t}/{v}": len({_bits(g) for g, it in zip(res["gates"], items)
                                      if it.task == t and it.variant == v})
                     for t in tasks for v in ("seen", "held-out")})
    # Each static baseline at exactly elastic's average MSR (scoring.static_at: two nested
    # fixed sets, the larger on a random share of the items).
    def at_budget(scores_lk):
      g = static_at(scores_lk, m, len(items), seed=args.seed)
      return scorer.score(items, "forced", gates=g), g.max(0).astype(int).tolist()

    res_s, g = at_budget(freq)
    record(f"{name}/most-chosen", res_s, gates=g)
    for sname, s in statics.items():
      res_s, g = at_budget(np.asarray(static_margin(s.params["static_logits"])))
      record(f"{name}/static:{sname}", res_s, gates=g, recipe=s.meta.get("recipe", "train"))
    if heads_json and "joint" in heads_json:
      res_s, g = at_budget(joint_order(heads_json, shape))
      record(f"{name}/greedy-oracle", res_s, gates=g)
    _write_json(args.out, results)
  for sname, s in statics.items():   # each static gate at its own trained decisions too
    g = (np.asarray(static_margin(s.params["static_logits"])) > 0).astype(np.float32)
    record(f"{sname}/as-trained", scorer.score(items, "forced", gates=g),
           gates=g.astype(int).tolist())
  _write_json(args.out, results)
  print(f"wrote {args.out} ({time.time() - t0:.0f}s)")
  return 0


def report(args) -> int:
  from elastic_jax.files import atomic_write_text
  from elastic_jax.repro import frontier_report as fr
  merged = None
  for path in args.scores:   # several files of the same items: their methods side by side
    try:
      with open(path, encoding="utf-8") as f:
        raw = json.load(f)
      raw["items"], raw["methods"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ElasticJaxError(f"{path}: cannot read a scores file ({type(e).__name__}: {e})"
                            ) from None
    if args.runs and len(args.scores) > 1:   # only what the chosen runs' rows need
      keep = set(args.runs.split(","))
      raw["methods"] = {n: b for n, b in raw["methods"].items()
                        if n.split("/")[0] in keep or n in ("full", "sparse", "task-oracle")
                        or n.startswith("task-set/")}
    if merged is None:
      merged = raw
      continue
    if raw["items"] != merged["items"]:
      raise ElasticJaxError(f"{path}: scores other items than {args.scores[0]} (another seed, "
                            "sample count or task list); only files of the same items combine")
    for name, body in raw["methods"].items():
      if name in merged["methods"] and body != merged["methods"][name]:
        if name in ("full", "sparse") or name.startswith(("task-set/", "task-oracle")):
          continue       # the endpoints scored again with each file: the first file's stay
        raise ElasticJaxError(f"{path}: method {name} is also in an earlier file, with other "
                              "results; rename one run")
      merged["methods"].setdefault(name, body)
  where = ", ".join(args.scores)
  try:
    s = fr.Scores(merged)
  except (ValueError, KeyError, TypeError) as e:
    raise ElasticJaxError(f"{where}: cannot read a scores file ({e})") from None
  runs = args.runs.split(",") if args.runs else s.elastic_runs()
  missing = [r for r in runs if f"{r}/elastic" not in s.methods]
  if missing:
    raise ElasticJaxError(f"{where}: no elastic run named {', '.join(missing)} (it has "
                          f"{', '.join(s.elastic_runs())})")
  runs = sorted(runs, key=lambda r: s.msr(f"{r}/elastic"))
  parts = [f"## {args.title}", "",
           f"Sensitive tasks ({', '.join(s.sensitive)}): accuracy % (MSR) of elastic and of "
           "each static head set "
           "at elastic's average MSR; elastic minus it, paired over the same items, points "
           "[95% interval].", "", fr.frontier_table(s, runs), ""]
  sets = fr.task_set_table(s)
  if sets:
    parts += ["Each task's greedy minimal head set, evaluated on every task (accuracy %):",
              "", sets, ""]
  if args.tables:
    parts += [fr.budget_table(s, r) for r in runs]
  text = "\n".join(parts) + "\n"
  if args.out:
    atomic_write_text(args.out, text)
  else:
    print(text)
  if args.plot:
    print(f"wrote {fr.plot(s, runs, args.plot, args.title)}")
  return 0


def representations(args) -> int:
  """Task-representation similarity before and after the Task MLP (the paper's Fig. 5)."""
  import jax
  from elastic_jax import router_io
  from elastic_jax.repro import frontier_report as fr
  from elastic_jax.repro.scoring import Scorer, eval_items, pooled_keys
  from elastic_jax.router import task_features
  r = router_io.load_routers(args.routers)
  if r.config.static:
    raise ElasticJaxError(f"{args.routers}: a static router has no task representation")
  if not r.config.task_mlp:
    raise ElasticJaxError(f"{args.routers}: these routers have no Task MLP to compare")
  import elastic_jax as ej
  model = ej.from_pretrained(args.model, dtype=args.dtype)
  scorer = Scorer(model.params, model.config, r.config, attn_impl=args.attn_impl,
                  rows=args.rows)
  tasks = tuple(args.tasks.split(","))
  items = eval_items(args.seed, args.samples, tasks, args.lengths_list, args.heldout_list)
  before = pooled_keys(scorer, items, r.params)                          # [N, L, K, H]
  after = np.stack([np.asarray(task_features(jax.tree.map(lambda x: x[l], r.params),
                                             before[:, l])) for l in range(before.shape[1])],
                   axis=1)
  labels = [it.task for it in items]
  names, sim_before = fr.task_similarity(before, labels)
  _, sim_after = fr.task_similarity(after, labels)
  text = ["| task | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
  for which, m in (("before", sim_before), ("after", sim_after)):
    for i, a in enumerate(names):
      text.append(f"| {a} ({which}) | " + " | ".join(f"{v:.2f}" for v in m[i]) + " |")
  print("\n".join(text))
  if args.out:
    _write_json(args.out, {"tasks": names, "before": sim_before.round(4).tolist(),
                           "after": sim_after.round(4).tolist(), "items": len(items),
                           "seed": args.seed})
  if args.plot:
    print(f"wrote {fr.similarity_plot(names, sim_before, sim_after, args.plot, args.title)}")
  return 0


def training(args) -> int:
  from elastic_jax.repro import frontier_report as fr
  try:
    with open(args.record, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise ElasticJaxError(f"{args.record}: cannot read a training record ({e})") from None
  runs = args.runs.split(",")
  missing = [r for r in runs if r not in record]
  if missing:
    raise ElasticJaxError(f"{args.record}: no run named {', '.join(missing)}")
  print(f"wrote {fr.training_plot(record, runs, args.plot)}")
  return 0


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
  from elastic_jax.resources import PACKAGE_DIR
  p = argparse.ArgumentParser(prog="python -m elastic_jax.repro.frontier", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  t = sub.add_parser("train", help="run a plan of router trainings")
  t.add_argument("plan", help="the plan (YAML)")
  t.add_argument("--out", required=True, help="folder of the runs (one run_dir per run)")
  t.add_argument("--parallel", type=int, default=1, help="trainings at a time")
  t.add_argument("--cwd", help="working directory of the trainings (relative paths)")
  for name, help_ in (("heads", "greedy minimal head sets per task"),
                      ("score", "teacher-forced evaluation of every method")):
    s = sub.add_parser(name, help=help_)
    s.add_argument("--model", default=os.path.join(PACKAGE_DIR, "repro", "backbone"),
                   help="the backbone")
    s.add_argument("--config", default="mixture.yaml",
                   help="run config whose router section sets the streaming heads' pattern")
    s.add_argument("--dtype", default="auto",
                   help="bfloat16, float32, float16 or auto (the checkpoint's own; default)")
    s.add_argument("--attn-impl", default="auto",
                   help="attention (reference compiles fastest at these sizes)")
    s.add_argument("--rows", type=int, default=64, help="rows per forward pass")
    s.add_argument("--out", required=True, help="the JSON file written")
  h = sub.choices["heads"]
  h.add_argument("--seed", type=int, default=3,
                 help="items' seed (not the evaluation's, so the sets are not chosen on it)")
  h.add_argument("--samples", type=int, default=64, help="items per task and variant")
  h.add_argument("--lengths", type=int, default=384, help="prompt length of the items")
  h.add_argument("--tasks", default="kv,hop,summary,pattern,fewshot",
                 help="tasks to find sets for (the families of eval/families.py too)")
  h.add_argument("--tolerance", type=float, default=0.02)
  h.add_argument("--seen-only", action="store_true", help="the seen variant's items only")
  h.add_argument("--keep", action="store_true",
                 help="keep the tasks already in --out (same settings) and measure the rest")
  s = sub.choices["score"]
  s.add_argument("--seed", type=int, default=1)
  s.add_argument("runs", nargs="+", help="sweep folders (train's --out) or NAME=ROUTER_DIR")
  s.add_argument("--heads", help="heads' JSON: adds each task's set and the greedy oracle")
  s.add_argument("--samples", type=int, default=200, help="items per task and variant")
  s.add_argument("--tasks", default="kv,hop,summary,pattern,fewshot",
                 help="the mixture's tasks evaluated (the families of eval/families.py too)")
  s.add_argument("--lengths", default="384")
  s.add_argument("--heldout-lengths", default="896")
  s.add_argument("--wordings", choices=("templates", "pretraining"), default="templates",
                 help="the seen variant's wordings: the templates, or the backbone's many "
                      "pretraining wordings (never the held-out one)")
  s.add_argument("--evidence", choices=("far", "near"), default="far",
                 help="near: the sensitive tasks' needed facts inside the streaming window")
  r = sub.add_parser("report", help="tables and the plot of a scores file")
  r.add_argument("scores", nargs="+",
                 help="score's JSON; several files of the same items are shown together")
  r.add_argument("--runs", help="elastic runs to show, comma-separated (default: all)")
  r.add_argument("--title", default="The accuracy-sparsity frontier")
  r.add_argument("--tables", action="store_true", help="also every budget's full table")
  r.add_argument("--out", help="Markdown file (default: print)")
  r.add_argument("--plot", help="PNG file of the frontier")
  v = sub.add_parser("representations",
                     help="task-representation similarity before and after the Task MLP")
  v.add_argument("--routers", required=True, help="the routers (a router export)")
  v.add_argument("--model", default=os.path.join(PACKAGE_DIR, "repro", "backbone"))
  v.add_argument("--dtype", default="auto",
                 help="bfloat16, float32, float16 or auto (the checkpoint's own; default)")
  v.add_argument("--attn-impl", default="reference")
  v.add_argument("--rows", type=int, default=32, help="rows per forward pass")
  v.add_argument("--seed", type=int, default=1)
  v.add_argument("--samples", type=int, default=20, help="items per task and variant")
  v.add_argument("--tasks", default="kv,hop,summary,pattern,fewshot")
  v.add_argument("--lengths", default="384")
  v.add_argument("--heldout-lengths", default="896")
  v.add_argument("--title", default="Task representations of the shipped routers")
  v.add_argument("--out", help="JSON of the two matrices")
  v.add_argument("--plot", help="PNG file")
  g = sub.add_parser("training", help="saturation and robust MSR during training, plotted")
  g.add_argument("record", help="a training record (docs/records/router_training.json)")
  g.add_argument("--runs", required=True, help="runs to draw, comma-separated")
  g.add_argument("--plot", required=True, help="PNG file")
  args = p.parse_args(argv)
  if args.command in ("score", "heads", "representations"):
    from elastic_jax.eval import mixture
    unknown = [t for t in args.tasks.split(",") if t not in mixture.ALL_TASKS]
    if unknown:
      raise ElasticJaxError(f"--tasks: {', '.join(unknown)} unknown (known: "
                            f"{', '.join(mixture.ALL_TASKS)})")
  if args.command in ("score", "representations"):
    try:
      args.lengths_list = [int(x) for x in args.lengths.split(",")]
      args.heldout_list = [int(x) for x in args.heldout_lengths.split(",")]
    except ValueError:
      raise ElasticJaxError("--lengths and --heldout-lengths are comma-separated numbers"
                            ) from None
  if getattr(args, "parallel", 1) < 1 or getattr(args, "samples", 1) < 1:
    raise ElasticJaxError("--parallel and --samples must be at least 1")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  return {"train": train, "heads": heads, "score": score, "report": report,
          "representations": representations, "training": training}[args.command](args)


if __name__ == "__main__":
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
