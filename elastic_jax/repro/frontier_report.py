"""Tables and the plot of the accuracy-sparsity frontier, from `frontier score`'s JSON.

Methods of a scores file (frontier.score): `full`, `sparse`, `task-set/TASK` (the greedy
minimal head set of one task), `S/as-trained` (a trained static gate's own decisions), and per
elastic run R: `R/elastic`, `R/most-chosen`, `R/static:S` (static gate S's heads ranked by
its logit margin, at R's average MSR) and `R/greedy-oracle`.

Every figure's title names the model, the routers and the setting; where a record does not
name the model, it is the frontier tools' default, the shipped backbone (DEFAULT_MODEL).
"""

from __future__ import annotations

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import mixture
from elastic_jax.eval.report import interval, paired_difference

VARIANTS = ("seen", "held-out")
DEFAULT_MODEL = "the shipped backbone (elastic_jax/repro/backbone)"
BASELINES = (("most-chosen", "static, elastic's most-chosen heads"),
             ("trained", "static, trained gate (best of the gates)"),
             ("duo", "DuoAttention's recipe"), ("prulong", "PruLong's recipe"),
             ("greedy-oracle", "static, greedy ablation (oracle)"))


class Scores:
  """A scores file: per method, item correctness (0/100) and MSR."""

  def __init__(self, raw: dict):
    try:
      self.items = raw["items"]
      self.methods = {name: {"correct": 100.0 * (np.frombuffer(m["correct"].encode(), np.uint8)
                                                 == ord("1")),
                             "msr": np.broadcast_to(np.asarray(m["msr"], float),
                                                    (len(raw["items"]),)),
                             **{k: v for k, v in m.items() if k not in ("correct", "msr")}}
                      for name, m in raw["methods"].items()}
    except (KeyError, TypeError, ValueError) as e:
      raise ElasticJaxError(f"not a frontier scores file ({type(e).__name__}: {e})") from None
    self.model = raw.get("model")
    self.setting = _setting(raw)
    self.task = np.array([it["task"] for it in self.items])
    self.variant = np.array([it["variant"] for it in self.items])
    present = set(self.task.tolist())
    self.tasks = [t for t in mixture.ALL_TASKS if t in present]          # table order
    self.sensitive = [t for t in self.tasks if mixture.is_sensitive(t)]
    self.robust = [t for t in self.tasks if not mixture.is_sensitive(t)]
    sets = [f"task-set/{t}" for t in self.tasks]
    if "task-oracle" not in self.methods and all(n in self.methods for n in sets):
      # Each item under its own task's set: the same forced pass as `frontier score`'s
      # task-oracle, read off the task sets' rows.
      pick = lambda key: sum(np.where(self.task == t, self.methods[f"task-set/{t}"][key], 0)
                             for t in self.tasks)
      self.methods["task-oracle"] = {"correct": pick("correct"), "msr": pick("msr")}

  def mask(self, variant: str | None = None, tasks=None) -> np.ndarray:
    m = np.ones(len(self.items), bool)
    if variant:
      m &= self.variant == variant
    if tasks is not None:
      m &= np.isin(self.task, list(tasks))
    return m

  def accuracy(self, method: str, variant=None, tasks=None) -> float:
    """Mean over tasks of each task's accuracy (equal weights, as the tables average)."""
    tasks = list(tasks or self.tasks)
    c = self.methods[method]["correct"]
    return float(np.mean([c[self.mask(variant, [t])].mean() for t in tasks
                          if self.mask(variant, [t]).any()]))

  def msr(self, method: str, variant=None, tasks=None) -> float:
    return float(self.methods[method]["msr"][self.mask(variant, tasks)].mean())

  def paired(self, a: str, b: str, variant=None, tasks=None) -> dict:
    m = self.mask(variant, tasks)
    return paired_difference(self.methods[a]["correct"][m], self.methods[b]["correct"][m])

  def best_trained(self, run: str, recipe: str = "train", tasks=None) -> str | None:
    """The static gate of `recipe` (R/static:S; train: train.py's router.static) of the
    highest accuracy on `tasks` over both variants at run R's budget: the strongest such
    baseline."""
    names = [n for n in self.methods if n.startswith(f"{run}/static:")
             and self.methods[n].get("recipe", "train") == recipe]
    return max(names, key=lambda n: self.accuracy(n, None, tasks or self.sensitive),
               default=None)

  def elastic_runs(self) -> list[str]:
    return [n[:-len("/elastic")] for n in self.methods if n.endswith("/elastic")]


def _setting(raw: dict) -> str:
  """A scores file's setting, for figure titles: the items' prompt lengths per variant (read
  off their keys, TASK/VARIANT/LENGTH/INDEX), samples, seed, wordings and evidence."""
  lengths: dict[str, set[str]] = {}
  for it in raw.get("items", ()):
    parts = str(it.get("key", "")).split("/")
    if len(parts) == 4 and parts[2].isdigit():
      lengths.setdefault(parts[1], set()).add(parts[2])
  parts = [", ".join(f"{v} {','.join(sorted(lengths[v], key=int))} tokens" for v in VARIANTS
                     if v in lengths),
           f"{raw['samples']} items per task and variant" if raw.get("samples") else "",
           f"seed {raw['seed']}" if raw.get("seed") is not None else "",
           f"{raw['wordings']} wordings" if raw.get("wordings") else "",
           f"evidence {raw['evidence']}" if raw.get("evidence") else ""]
  return "; ".join(p for p in parts if p)


def _fmt_diff(d: dict) -> str:
  return f"{d['diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]"


def baseline_of(s: Scores, run: str, kind: str) -> str | None:
  if kind in ("trained", "duo", "prulong"):
    return s.best_trained(run, "train" if kind == "trained" else kind)
  name = f"{run}/{kind}"
  return name if name in s.methods else None


def present_baselines(s: Scores, runs: list[str]) -> list[tuple[str, str]]:
  """The baselines (kind, label) that at least one of the runs has."""
  return [(k, label) for k, label in BASELINES if any(baseline_of(s, r, k) for r in runs)]


def frontier_table(s: Scores, runs: list[str]) -> str:
  """Per budget: average MSR, the sensitive tasks' accuracy (seen / held-out) of elastic and
  every static baseline at its average MSR, and elastic minus each, paired over the same
  items (points [95% interval])."""
  sens = s.sensitive
  kinds = present_baselines(s, runs)
  lines = ["| budget (avg MSR) | variant | elastic | robust MSR | "
           + " | ".join(f"{label}: acc (MSR) | elastic − it" for _, label in kinds) + " |",
           "|---|---|---|---|" + "---|---|" * len(kinds)]
  for run in runs:
    e = f"{run}/elastic"
    for variant in VARIANTS:
      cells = [f"{run} ({s.msr(e):.3f})" if variant == "seen" else "", variant,
               f"{s.accuracy(e, variant, sens):.1f} ({s.msr(e, variant, sens):.2f})",
               f"{s.msr(e, variant, s.robust):.2f}"]
      for kind, _ in kinds:
        b = baseline_of(s, run, kind)
        if b is None:
          cells += ["-", "-"]
          continue
        tag = f" `{b.split(':')[1]}`" if kind in ("trained", "prulong") else ""
        cells += [f"{s.accuracy(b, variant, sens):.1f} ({s.msr(b):.2f}){tag}",
                  _fmt_diff(s.paired(e, b, variant, sens))]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def budget_table(s: Scores, run: str) -> str:
  """The paper's Table 1 layout at one budget: every method, accuracy % (MSR) per task."""
  methods = [("Full attention", "full"), ("All heads SSA", "sparse"),
             ("Elastic", f"{run}/elastic")]
  for kind, label in BASELINES:
    b = baseline_of(s, run, kind)
    if b:
      methods.append((label.capitalize(), b))
  lines = []
  for variant in VARIANTS:
    lines += [f"**{run}, {variant}** (accuracy % with its 95% interval below; MSR)", "",
              "| method | " + " | ".join(s.tasks) + " | sensitive avg | robust avg | "
              "MSR avg |", "|---|" + "---|" * (len(s.tasks) + 3)]
    for label, name in methods:
      cells = []
      for t in s.tasks:
        m = s.mask(variant, [t])
        c = s.methods[name]["correct"][m]
        lo, hi = interval(c)
        cells.append(f"{c.mean():.1f} ({s.methods[name]['msr'][m].mean():.2f})<br>"
                     f"[{lo:.0f}, {hi:.0f}]")
      rob = f"{s.accuracy(name, variant, s.robust):.1f}" if s.robust else "-"
      lines.append(f"| {label} | " + " | ".join(cells)
                   + f" | {s.accuracy(name, variant, s.sensitive):.1f} | "
                   f"{rob} | {s.msr(name, variant):.2f} |")
    lines.append("")
  return "\n".join(lines)


def task_set_table(s: Scores) -> str:
  """Each task's greedy minimal head set applied to every task: how the sets differ."""
  names = [n for n in s.methods if n.startswith("task-set/")]
  if not names:
    return ""
  lines = ["| head set of | heads full | the (layer, KV head) pairs | "
           + " | ".join(s.tasks) + " |", "|---|---|---|" + "---|" * len(s.tasks)]
  for n in names:
    g = np.asarray(s.methods[n].get("gates", []))
    pairs = " ".join(f"({a},{b})" for a, b in np.argwhere(g > 0)) if g.size else "-"
    lines.append(f"| {n.split('/', 1)[1]} | {int(g.sum()) if g.size else '-'} | "
                 f"{pairs or 'none'} | "
                 + " | ".join(f"{s.accuracy(n, None, [t]):.1f}" for t in s.tasks)
                 + " |")
  if "task-oracle" in s.methods:
    lines.append(f"| each item its task's set | MSR {s.msr('task-oracle'):.3f} | | "
                 + " | ".join(f"{s.accuracy('task-oracle', None, [t]):.1f}"
                              for t in s.tasks) + " |")
  return "\n".join(lines)


def plot(s: Scores, runs: list[str], path: str, title: str, model: str | None = None,
         routers: str | None = None, setting: str | None = None) -> str:
  """Sensitive-task accuracy against average MSR, one panel per variant, every method. model,
  routers, setting: for the title (default: the scores file's model, else DEFAULT_MODEL; the
  elastic runs; the scores file's setting)."""
  from elastic_jax.eval.report import figure_title, pyplot, save_figure
  import os
  plt = pyplot()
  sens = s.sensitive
  fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.4), sharey=True, layout="constrained")
  series = [("elastic", lambda r: f"{r}/elastic", "o-", "C0")]
  series += [(label, (lambda k: lambda r: baseline_of(s, r, k))(kind), "s--", f"C{i + 1}")
             for i, (kind, label) in enumerate(present_baselines(s, runs))]
  xs = [s.msr("sparse")] + [s.msr(n) for _, name_of, _, _ in series
                            for n in map(name_of, runs) if n]
  if "task-oracle" in s.methods:
    xs.append(s.msr("task-oracle"))
  for ax, variant in zip(axes, VARIANTS):
    for label, name_of, style, color in series:
      pts = sorted((s.msr(n), s.accuracy(n, variant, sens)) for n in map(name_of, runs) if n)
      if pts:
        ax.plot(*zip(*pts), style, color=color, label=label, markersize=5)
    ax.axhline(s.accuracy("full", variant, sens), color="k", linestyle=":", linewidth=1,
               label="full attention (MSR 0)")
    if "task-oracle" in s.methods:
      ax.scatter([s.msr("task-oracle")], [s.accuracy("task-oracle", variant, sens)],
                 marker="*", s=110, color="C6", zorder=3,
                 label="each task's minimal set (a router that knows the task)")
    ax.scatter([s.msr("sparse")], [s.accuracy("sparse", variant, sens)], marker="X", s=70,
               color="0.5", label="all heads streaming", zorder=3)
    ax.set_xlim(min(0.6, min(xs) - 0.05), 1.02)
    ax.set_title(f"{variant}", fontsize=10)
    ax.set_xlabel("average MSR over the tasks (share of heads sparse)")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel(f"accuracy on {', '.join(sens)} (%)")
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)), fontsize=8)
  fig.suptitle(figure_title(title, model or s.model or DEFAULT_MODEL,
                            routers or "elastic runs " + ", ".join(runs), setting or s.setting),
               fontsize=10)
  path = save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))
  plt.close(fig)
  return path


def training_plot(record: dict, runs: list[str], path: str,
                  title: str = "Routing decisions during training",
                  model: str | None = None, setting: str | None = None) -> str:
  """Per run, the share of the batch's routing decisions whose margin is saturated (mean over
  layers) and the robust tasks' MSR during training, from a training record (one entry per
  run: its logged steps). model, setting: for the title (default: DEFAULT_MODEL; the task
  mixture's training batches)."""
  import os
  from elastic_jax.eval.report import figure_title, pyplot, save_figure
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
  robust = ("summarization", "code", "icl")
  for i, run in enumerate(runs):
    steps = record[run]["steps"]
    x = [r["step"] for r in steps]
    sat = [np.mean(r["saturated"]) if r.get("saturated") else np.nan for r in steps]
    rob = [np.mean([r["msr_task"].get(t, np.nan) for t in robust]) for r in steps]
    axes[0].plot(x, sat, color=f"C{i % 10}", label=run)
    axes[1].plot(x, rob, color=f"C{i % 10}", label=run)
  axes[0].set_ylabel("saturated decisions (share, 0-1)")
  axes[1].set_ylabel("robust tasks' MSR (share sparse)")
  for ax in axes:
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
  handles, labels = axes[1].get_legend_handles_labels()
  fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncols=min(4, len(labels)))
  fig.suptitle(figure_title(title, model or DEFAULT_MODEL, ", ".join(runs),
                            setting or "the task mixture's training batches"), fontsize=10)
  path = save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))
  plt.close(fig)
  return path


def task_similarity(features_nlkh: np.ndarray, tasks: list[str]) -> tuple[list[str], np.ndarray]:
  """Mean cosine similarity between the representations of items of two tasks (the diagonal:
  pairs of distinct items of one task), per layer then averaged over layers; an item's
  representation in a layer is its KV heads' vectors side by side, less their mean over all
  the items (uncentred, a component every prompt shares puts every pair near 1). ->
  (task order, [T, T])."""
  names = [t for t in mixture.ALL_TASKS if t in set(tasks)]
  tasks = np.asarray(tasks)
  n, layers = features_nlkh.shape[:2]
  sims = np.zeros((layers, len(names), len(names)))
  for l in range(layers):
    x = features_nlkh[:, l].reshape(n, -1).astype(np.float64)
    x = x - x.mean(0, keepdims=True)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    cos = x @ x.T
    for i, a in enumerate(names):
      for j, b in enumerate(names):
        block = cos[np.ix_(tasks == a, tasks == b)]
        if a == b:
          k = block.shape[0]
          sims[l, i, j] = (block.sum() - np.trace(block)) / max(k * (k - 1), 1)
        else:
          sims[l, i, j] = block.mean()
  return names, sims.mean(0)


def similarity_plot(names: list[str], before: np.ndarray, after: np.ndarray, path: str,
                    title: str, model: str | None = None, routers: str | None = None,
                    setting: str | None = None) -> str:
  """The paper's Fig. 5 at this scale: task-representation similarity before and after the
  Task MLP, one heatmap each, the values written in their cells. model, routers, setting: for
  the title (default: DEFAULT_MODEL; the shipped routers)."""
  import os
  from elastic_jax.eval.report import figure_title, pyplot, save_figure
  plt = pyplot()
  side = 2.2 + 0.55 * len(names)
  fig, axes = plt.subplots(1, 2, figsize=(2 * side + 1.5, side + 1.2), layout="constrained")
  for ax, m, label in ((axes[0], before, "pooled keys (before the Task MLP)"),
                       (axes[1], after, "after the Task MLP")):
    im = ax.imshow(m, vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
    ax.set_yticks(range(len(names)), names if ax is axes[0] else [], fontsize=8)
    for i in range(len(names)):
      for j in range(len(names)):
        ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7,
                color="white" if abs(m[i, j]) > 0.6 else "black")
    ax.set_title(label, fontsize=9)
    ax.set_xlabel("task of the second item")
  axes[0].set_ylabel("task of the first item")
  fig.colorbar(im, ax=axes, shrink=0.8, label="mean cosine similarity (centred, -1 to 1)")
  fig.suptitle(figure_title(title, model or DEFAULT_MODEL, routers or "the shipped routers",
                            setting), fontsize=10)
  path = save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))
  plt.close(fig)
  return path
