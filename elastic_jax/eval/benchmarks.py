"""The benchmarks `eval.py` runs, each one object in a registry:

    BENCHMARKS["ruler"].items(args, tokenizer, max_positions) -> [Item]
    BENCHMARKS["ruler"].score(task, predictions, items) -> score (0-100)
    BENCHMARKS["ruler"].category(task) -> the report's row group

A benchmark also declares its command-line options (`add_arguments`) and may name the task
type of each task (`task_type`, for the target MSR drawn on the plots). `items` keeps what
`score` needs (the samples, the references) on the object, so the two are called on the same
instance.
"""

from __future__ import annotations

import argparse
import os
from importlib import resources
from typing import Any

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval.runner import Item


def positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def int_list(text: str) -> str:
  values = [x.strip() for x in text.split(",") if x.strip()]
  if not values:
    raise argparse.ArgumentTypeError("needs at least one value")
  for x in values:
    positive_int(x)
  return text


def csv(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def chat_flag(args) -> bool | None:
  return {"auto": None, "on": True, "off": False}[args.chat]


class Benchmark:
  name = ""
  help = ""
  model_default: str | None = None        # a shipped model this benchmark runs on by default

  def add_arguments(self, p: argparse.ArgumentParser) -> None:
    pass

  def items(self, args, tokenizer, max_positions: int) -> list[Item]:
    raise NotImplementedError

  def score(self, task: str, predictions: list[str], items: list[Item]) -> float:
    raise NotImplementedError

  def category(self, task: str) -> str:
    return task

  def task_type(self, task: str) -> str | None:
    """The objective's task type (tasks.TASK_TYPES) of a task, if the benchmark knows it."""
    return None


class Ruler(Benchmark):
  name, help = "ruler", "RULER's synthetic tasks, generated locally"

  def add_arguments(self, p):
    p.add_argument("--lengths", default="4096", type=int_list,
                   help="comma-separated context lengths (tokens)")
    p.add_argument("--tasks", default="niah_single_1,niah_multikey_1,vt,cwe",
                   help="comma-separated RULER tasks (default niah_single_1,niah_multikey_1,vt,"
                        "cwe)")
    p.add_argument("--samples", type=positive_int, default=4, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")

  def items(self, args, tokenizer, max_positions):
    from elastic_jax.eval import ruler
    from elastic_jax.eval.longbench import apply_chat_template, input_ids
    lengths = [int(x) for x in csv(args.lengths)]
    if any(n > max_positions for n in lengths):
      raise ElasticJaxError(f"--lengths {args.lengths}: the model holds at most "
                            f"{max_positions} positions")
    chat = chat_flag(args)
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    out, self.samples = [], {}
    for task in csv(args.tasks):
      for n in lengths:
        for s in ruler.generate(task, tokenizer, n, args.samples, seed=args.seed):
          text = apply_chat_template(s.input, tokenizer) if use_chat else s.input
          text += s.answer_prefix
          key = f"{task}/{n}/{s.index}"
          out.append(Item(key, f"{task}@{n}", tuple(input_ids(text, tokenizer, use_chat)),
                          s.max_new_tokens))
          self.samples[key] = s
    return out

  def score(self, task, predictions, items):
    from elastic_jax.eval import ruler
    return ruler.score(task.split("@")[0], predictions, [self.samples[it.key] for it in items])

  def category(self, task):
    name = task.split("@")[0]
    return ("retrieval (NIAH)" if name.startswith("niah") else
            "multi-hop tracing" if name == "vt" else "aggregation")

  def task_type(self, task):
    name = task.split("@")[0]
    return "single_qa" if name.startswith("niah") else "multihop_qa" if name == "vt" else None


class Mixture(Benchmark):
  name = "mixture"
  help = "the reproduction's synthetic task mixture (eval/mixture.py), seen and held-out"

  @property
  def model_default(self):
    return str(resources.files("elastic_jax.repro").joinpath("backbone"))

  def add_arguments(self, p):
    p.add_argument("--lengths", default="384", type=int_list,
                   help="prompt lengths (tokens) of the seen variant: training templates")
    p.add_argument("--heldout-lengths", default="896", type=int_list,
                   help="prompt lengths of the held-out variant: the held-out template")
    p.add_argument("--tasks", default="kv,hop,summary,pattern,fewshot",
                   help="comma-separated tasks of the mixture (default kv,hop,summary,pattern,"
                        "fewshot)")
    p.add_argument("--samples", type=positive_int, default=8,
                   help="samples per task, variant and length")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn samples (default 0)")

  def items(self, args, tokenizer, max_positions):
    from elastic_jax.eval import mixture
    mixture.check_tokenizer(tokenizer, args.model)
    lengths = [int(x) for x in csv(args.lengths)]
    heldout = [int(x) for x in csv(args.heldout_lengths)]
    for n in lengths + heldout:
      if not 16 <= n <= max_positions - 64:
        raise ElasticJaxError(f"length {n}: must lie in [16, {max_positions - 64}] for this "
                              "model")
    tasks = csv(args.tasks)
    for task in tasks:
      if task not in mixture.ALL_TASKS:
        raise ElasticJaxError(f"--tasks: '{task}' is unknown (known: "
                              f"{', '.join(mixture.ALL_TASKS)})")
    out, self.answers = [], {}
    for key, variant, s in mixture.eval_samples(args.seed, args.samples, tasks, lengths,
                                                heldout):
      ids = (mixture.BOS, *map(int, s.context), *map(int, s.question))
      out.append(Item(key, f"{s.task}@{variant}", ids, len(s.answer) + 1))
      self.answers[key] = mixture.decode(s.answer)
    return out

  def score(self, task, predictions, items):
    return 100.0 * float(np.mean([p.split() == self.answers[it.key].split()
                                  for p, it in zip(predictions, items)]))

  def category(self, task):
    from elastic_jax.eval import mixture
    return mixture.TASK_TYPE[task.split("@")[0]]

  def task_type(self, task):
    from elastic_jax.tasks import task_id, TASK_TYPES
    return TASK_TYPES[task_id(self.category(task))]


class LongBench(Benchmark):
  name, help = "longbench", "LongBench (or LongBench-E with --e) from local files"
  v2 = False

  def add_arguments(self, p):
    p.add_argument("--data", required=True, help="directory holding the published files")
    p.add_argument("--limit", type=positive_int, help="at most this many records per dataset")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="prompt tokens kept (middle truncation; default LongBench's 31500, "
                        "120000 for v2, capped by the model)")
    if not self.v2:
      p.add_argument("--datasets", help="comma-separated datasets (default: all)")
      p.add_argument("--e", action="store_true", help="LongBench-E (*_e.jsonl), by length")

  def items(self, args, tokenizer, max_positions):
    from elastic_jax.eval import longbench as lb
    from elastic_jax.eval.metrics import longbench_e_bucket
    if self.v2:
      records = lb.load_longbench_v2(args.data, limit=args.limit)
    else:
      records = lb.load_longbench(args.data, csv(args.datasets) if args.datasets else None,
                                  e=args.e, limit=args.limit)
    default = lb.V2_DEFAULT_MAX_LENGTH if self.v2 else lb.V1_MAX_LENGTH
    out, self.records = [], {}
    for rec in records:
      max_new = lb.V2_MAX_NEW_TOKENS if self.v2 else lb.MAX_NEW_TOKENS[rec.dataset]
      max_len = min(args.max_length or default, max_positions - max_new)
      text, max_new, apply_chat = lb.model_input(rec, tokenizer, max_len, chat_flag(args))
      key = f"{'longbench-v2' if self.v2 else rec.dataset}/{rec.id}"
      # LongBench-E is reported per dataset and length bucket (0-4k, 4-8k, 8k+), as published.
      task = (f"{rec.difficulty}/{rec.length}" if self.v2 else
              f"{rec.dataset}@{longbench_e_bucket(rec.length)}" if rec.e else rec.dataset)
      out.append(Item(key, task, tuple(lb.input_ids(text, tokenizer, apply_chat)), max_new,
                      tuple(lb.extra_stop_ids(rec, tokenizer))))
      self.records[key] = rec
    return out

  def score(self, task, predictions, items):
    from elastic_jax.eval import metrics
    recs = [self.records[it.key] for it in items]
    if self.v2:
      return metrics.score_longbench_v2(
          [{"difficulty": r.difficulty, "length": r.length, "answer": r.answer} for r in recs],
          predictions)["overall"]
    return metrics.score_longbench(recs[0].dataset, predictions,
                                   [list(r.answers) for r in recs], recs[0].all_classes)

  def category(self, task):
    from elastic_jax.eval import metrics
    return "LongBench-v2" if self.v2 else metrics.DATASET_CATEGORY[task.split("@")[0]]

  def task_type(self, task):
    return {"Single-Doc QA": "single_qa", "Multi-Doc QA": "multihop_qa",
            "Summarization": "summarization", "Code": "code",
            "Few-shot Learning": "icl"}.get(self.category(task))


class LongBenchV2(LongBench):
  name, help, v2 = "longbench-v2", "LongBench-v2 from its published data.json", True


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (Ruler(), Mixture(), LongBench(),
                                                         LongBenchV2())}


def resolve_model(args, benchmark: Benchmark) -> Any:
  """--model, or the benchmark's shipped default."""
  if args.model is None:
    if benchmark.model_default is None:
      raise ElasticJaxError(f"{benchmark.name} needs --model")
    args.model = benchmark.model_default
  return os.fspath(args.model)
