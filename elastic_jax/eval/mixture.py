"""A synthetic long-context task mixture with both regimes of the paper, for a small model.

Every sample is filler text (sentences of plain words) with a task inside it, then a question,
then a short answer. Five tasks, one per task type of the authors (docs/method.md §7):

  task     type                 regime     what the answer needs
  kv       Single QA            sensitive  the value of one key among many facts, anywhere
  hop      MultiHop QA          sensitive  two chained facts anywhere: "a -> b", "b -> 42"
  summary  Summarization        robust     the headline (first three words) of the last passage
  pattern  Code                 robust     the next tokens of a repeating line at the end
  fewshot  In-Context Learning  robust     a mapping shown by examples in the last passage

The robust tasks put everything the answer needs in the last few dozen tokens (inside a
streaming head's local window); the sensitive ones place their facts in the first 80% of the
context, far outside it. Each task has three templates (wordings of facts, markers and
question): 0 and 1 are the training templates, 2 is held out (the "held-out" variant, which
also uses longer contexts). The backbone's pretraining sees all three templates, so held-out
means unseen by the routers, not by the backbone.

Everything is word-level: one word = one token of the shipped tokenizer (`build_tokenizer`),
so lengths are exact token counts and the generator works on id arrays (fast enough to feed
pretraining on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from importlib import resources
from typing import Iterator, Sequence

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import families
from elastic_jax.eval.words import (  # noqa: F401  (the mixture's vocabulary)
    ALL_TASKS, BOS, CONNECTORS, DOT, EOS, FACT_ZONE, FAMILY_TASKS, FAMILY_TYPE, FILLER_IDS,
    HELDOUT_TEMPLATE, IDS, NAME_IDS, NUMBER_IDS, NUM_FILLER, NUM_NAMES, NUM_NUMBERS, PAD,
    PRETRAIN_FACTS, PRETRAIN_FILLER, PRETRAIN_QUESTIONS, PUNCT, SENSITIVE, SPECIALS, Sample,
    TASKS, TASK_TYPE, TEMPLATES, TEMPLATE_WORDS, TEMPLATE_WORD_IDS, TRAIN_TEMPLATES, UNK, VOCAB,
    check_tokenizer, decode, distinct_ids, encode, fill_template, filler_tokens, insert_pieces,
    random_wording, random_words, vocabulary)

EVIDENCE = ("far", "near")


def make_sample(task: str, rng: np.random.Generator, length: int, template: int,
                extra_queries: int = 0, *, wording: tuple[str, str] | None = None,
                n_facts: int | None = None, filler: np.ndarray = FILLER_IDS,
                evidence: str = "far") -> Sample:
  """One sample whose prompt (context + question) has about `length` tokens (exactly, up to
  the last fact's words). extra_queries: more questions on the same context (kv, hop).
  Pretraining's knobs: wording, a (fact, question) pair instead of the template's (template
  is then only recorded); n_facts, the facts of kv and hop (default length // 96, in 2..40);
  filler, the words of the filler sentences. evidence (sensitive tasks): "far", the facts
  in the first 80% of the context; "near", the facts the answer needs at the context's end,
  inside a streaming head's window, the others where they were (a check, not a task)."""
  if evidence not in EVIDENCE:
    raise ElasticJaxError(f"evidence '{evidence}' is unknown ({', '.join(EVIDENCE)})")
  if task in families.FAMILY_TASKS:
    return families.make(task, rng, length, template, wording=wording, filler=filler,
                         evidence=evidence)
  if task not in TASKS:
    raise ElasticJaxError(f"task '{task}' is unknown (known: {', '.join(ALL_TASKS)})")
  fact, question = wording or TEMPLATES[task][template]
  if task in SENSITIVE:
    n_facts = int(np.clip(length // 96, 2, 40)) if n_facts is None else max(2, n_facts)
    if task == "kv":
      keys = distinct_ids(rng, NAME_IDS, n_facts)
      vals = NUMBER_IDS[rng.integers(0, NUM_NUMBERS, n_facts)]
      pieces = [fill_template(fact, k=k, v=v) for k, v in zip(keys, vals)]
      asked = rng.choice(n_facts, size=1 + min(extra_queries, n_facts - 1), replace=False)
      qa = [(fill_template(question, k=keys[i]), vals[i:i + 1]) for i in asked]
    else:
      n_chains = max(1, n_facts // 2)
      names = distinct_ids(rng, NAME_IDS, 2 * n_chains)
      vals = NUMBER_IDS[rng.integers(0, NUM_NUMBERS, n_chains)]
      pieces = []
      for c in range(n_chains):
        a, b = names[2 * c], names[2 * c + 1]
        pieces += [fill_template(fact, a=a, b=b), fill_template(fact, a=b, b=vals[c])]
      asked = rng.choice(n_chains, size=1 + min(extra_queries, n_chains - 1), replace=False)
      qa = [(fill_template(question, a=names[2 * c]), np.array([names[2 * c + 1], vals[c]], np.int32))
            for c in asked]
    body = sum(len(p) for p in pieces)
    n_fill = max(8, length - body - len(qa[0][0]))
    if evidence == "near":
      if extra_queries:
        raise ElasticJaxError("evidence 'near' places one question's facts; ask one")
      need = [asked[0]] if task == "kv" else [2 * asked[0], 2 * asked[0] + 1]
      far = [p for i, p in enumerate(pieces) if i not in need]
      context = np.concatenate([insert_pieces(rng, filler_tokens(rng, n_fill, filler), far, FACT_ZONE)]
                               + [pieces[i] for i in need])
    else:
      context = insert_pieces(rng, filler_tokens(rng, n_fill, filler), pieces, FACT_ZONE)
    return Sample(task, template, context, qa[0][0], qa[0][1], tuple(qa[1:]),
                  n_facts if task == "kv" else len(pieces) // 2)
  if task == "summary":   # the passage's headline: its first three words
    words = FILLER_IDS[rng.integers(0, NUM_FILLER, rng.integers(6, 10))]
    tail = np.concatenate([encode(fact), words, [DOT]])
    answer, q = words[:3], encode(question)
  elif task == "pattern":
    period = int(rng.integers(2, 5))
    n = int(rng.integers(8, 13))
    line = np.resize(distinct_ids(rng, NAME_IDS, period), n + 3)
    tail = np.concatenate([encode(fact), line[:n]])
    answer, q = line[n:], encode(question)
  else:  # fewshot: "marker : " then the pairs
    marker, pair = fact.split(" ", 2)[:2], fact.split(" ", 2)[2]
    n = int(rng.integers(3, 6))
    keys = distinct_ids(rng, NAME_IDS, n)
    vals = NUMBER_IDS[rng.integers(0, NUM_NUMBERS, n)]
    tail = np.concatenate([encode(" ".join(marker))]
                          + [fill_template(pair, k=k, v=v) for k, v in zip(keys, vals)])
    i = int(rng.integers(0, n))
    answer, q = vals[i:i + 1], fill_template(question, k=keys[i])
  n_fill = max(8, length - len(tail) - len(q))
  context = np.concatenate([filler_tokens(rng, n_fill, filler), tail])
  return Sample(task, template, context, q, np.asarray(answer, np.int32),
                candidates=n if task == "fewshot" else 0)


# ----------------------------------------------------------------------------------------------
# Pretraining's extras


def pretraining_wording(task: str, rng: np.random.Generator,
                        heldout: bool = False) -> tuple[str, str]:
  """A (fact, question) wording of `task` for pretraining: half of the time one of
  PRETRAIN_FACTS x PRETRAIN_QUESTIONS, else random words (`random_wording`). Never the
  held-out template's wording unless `heldout` (then it is among the fixed ones)."""
  if task in families.FAMILY_TASKS:
    return families.pretraining_wording(task, rng, heldout)
  avoid = TEMPLATES[task][HELDOUT_TEMPLATE]
  while True:
    if rng.random() < 0.5:
      wording = random_wording(task, rng)
    else:
      facts = PRETRAIN_FACTS[task] + ((avoid[0],) if heldout else ())
      fact = facts[int(rng.integers(len(facts)))]
      if task == "fewshot":
        pair = fact.split(" ", 2)[2]
        wording = fact, pair[:pair.index("{v}")].strip()
      elif heldout and fact == avoid[0] and rng.random() < 0.5:
        wording = avoid
      else:
        questions = PRETRAIN_QUESTIONS[task]
        wording = fact, questions[int(rng.integers(len(questions)))]
    if heldout or (" ".join(wording[0].split()) != avoid[0]
                   and " ".join(wording[1].split()) != avoid[1]):
      return wording


def copy_sample(rng: np.random.Generator, length: int,
                filler: np.ndarray = PRETRAIN_FILLER) -> Sample:
  """The pretraining's auxiliary copy task: a string of 10-20 distinct names and numbers in
  the first 80% of filler; the question is its first two tokens, the answer the rest. It
  trains the look-back heads that bind a value to the token before it (docs/results.md)."""
  pool = np.concatenate([NAME_IDS, NUMBER_IDS])
  string = pool[rng.choice(len(pool), int(rng.integers(10, 21)), replace=False)]
  context = insert_pieces(rng, filler_tokens(rng, max(8, length - len(string)), filler), [string],
                    FACT_ZONE)
  return Sample("copy", -1, context, string[:2], string[2:])


def check_wordings() -> None:
  """Raises if a pretraining wording is the held-out template's (it must stay unseen), for
  the five tasks and the families."""
  for task, (fact, question) in ((t, TEMPLATES[t][HELDOUT_TEMPLATE]) for t in TASKS):
    if fact in PRETRAIN_FACTS[task] or question in PRETRAIN_QUESTIONS.get(task, ()):
      raise ElasticJaxError(f"the held-out wording of {task} is among the pretraining ones")
  families.check_wordings()


# ----------------------------------------------------------------------------------------------
# Variants and files


@dataclasses.dataclass(frozen=True)
class Variant:
  """Which templates and prompt lengths a set of samples uses."""
  name: str
  templates: tuple[int, ...]
  min_len: int
  max_len: int

  def __post_init__(self):
    if not 16 <= self.min_len <= self.max_len:
      raise ElasticJaxError(f"variant '{self.name}': lengths must satisfy 16 <= min_len <= "
                            f"max_len, got {self.min_len} and {self.max_len}")
    if not self.templates or any(t not in (0, 1, 2) for t in self.templates):
      raise ElasticJaxError(f"variant '{self.name}': templates must be among 0, 1, 2")


def samples(variant: Variant, n_per_task: int, seed: int, tasks: Sequence[str] = TASKS,
            random_wordings: float = 0.0) -> Iterator[Sample]:
  """n_per_task samples of each task, interleaved, deterministic in (seed, variant). A share
  `random_wordings` of them is worded like the backbone's pretraining (`pretraining_wording`:
  many fixed wordings and random ones, never the held-out template's); their template is -1."""
  if not 0.0 <= random_wordings <= 1.0:
    raise ElasticJaxError(f"the share of random wordings must lie in [0, 1], got "
                          f"{random_wordings}")
  rng = np.random.default_rng([seed, sum(map(ord, variant.name))])
  for i in range(n_per_task):
    for task in tasks:
      length = int(rng.integers(variant.min_len, variant.max_len + 1))
      template = variant.templates[int(rng.integers(0, len(variant.templates)))]
      if random_wordings and rng.random() < random_wordings:
        yield make_sample(task, rng, length, -1, wording=pretraining_wording(task, rng))
      else:
        yield make_sample(task, rng, length, template)


EVAL_VARIANTS = (("seen", TRAIN_TEMPLATES), ("held-out", (HELDOUT_TEMPLATE,)))


def is_sensitive(task: str) -> bool:
  """Whether the task's evidence lies outside a streaming head's window (kv, hop and every
  family task)."""
  return task in SENSITIVE or task in families.FAMILY_TASKS


def eval_samples(seed: int, n: int, tasks: Sequence[str], lengths: Sequence[int],
                 heldout_lengths: Sequence[int], *, wordings: str = "templates",
                 evidence: str = "far") -> Iterator[tuple[str, str, Sample]]:
  """The evaluation's items, as `eval.py mixture` draws them: (key, variant, sample) for every
  task, variant (seen: the training templates at `lengths`; held-out: the held-out template
  at `heldout_lengths`), length and index below n. Each cell's draws depend on (seed, the
  task's place in `tasks`, the variant, the length) alone. Checks on other items:
  wordings="pretraining" words the seen variant as the backbone's pretraining did (many fixed
  and random wordings, never the held-out one); evidence="near" puts the sensitive tasks'
  needed facts inside a streaming head's window (make_sample)."""
  if wordings not in ("templates", "pretraining"):
    raise ElasticJaxError(f"wordings '{wordings}' is unknown (templates, pretraining)")
  for t, task in enumerate(tasks):
    if task not in ALL_TASKS:
      raise ElasticJaxError(f"task '{task}' is unknown (known: {', '.join(ALL_TASKS)})")
    for v, ((variant, templates), cell_lengths) in enumerate(
        zip(EVAL_VARIANTS, (lengths, heldout_lengths))):
      for length in cell_lengths:
        rng = np.random.default_rng([seed, t, v, length])
        for i in range(n):
          if wordings == "pretraining" and variant == "seen":
            s = make_sample(task, rng, length, -1, wording=pretraining_wording(task, rng),
                            evidence=evidence)
          else:
            s = make_sample(task, rng, length, templates[i % len(templates)],
                            evidence=evidence)
          yield f"{task}/{variant}/{length}/{i}", variant, s


def write_jsonl(path: str, variant: Variant, n_per_task: int, seed: int,
                tasks: Sequence[str] = TASKS, random_wordings: float = 0.0) -> int:
  """Writes train.py records; atomic (a temporary file renamed). Returns the record count."""
  from elastic_jax.files import atomic_write_text
  lines = [json.dumps(s.record())
           for s in samples(variant, n_per_task, seed, tasks, random_wordings)]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  atomic_write_text(path, "\n".join(lines) + "\n")
  return len(lines)


def build_tokenizer(directory: str) -> None:
  """Writes a Hugging Face fast tokenizer (word level, BOS added) for VOCAB into directory."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  from elastic_jax.tokenizer import tokenizer_only
  with tokenizer_only():
    from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)])
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>", unk_token="<unk>")
  fast.save_pretrained(directory)


def parse_tasks(text: str, flag: str = "--tasks") -> tuple[str, ...]:
  """A comma-separated list of distinct task names of ALL_TASKS; one sentence if not."""
  tasks = tuple(t.strip() for t in text.split(",") if t.strip())
  if (not tasks or len(set(tasks)) != len(tasks)
      or any(t not in ALL_TASKS for t in tasks)):
    raise ElasticJaxError(f"{flag}: distinct names among {', '.join(ALL_TASKS)}, got "
                          f"{','.join(tasks) or 'none'}")
  return tasks


def main(argv=None) -> int:
  """python -m elastic_jax.eval.mixture OUT_DIR [--per-task N] ...: training data of the
  mixture for train.py (OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl; name them in
  data.train_path and data.eval_path)."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m elastic_jax.eval.mixture", description=main.__doc__)
  p.add_argument("out", help="folder for train.jsonl and eval.jsonl")
  p.add_argument("--per-task", type=int, default=80, help="training records per task")
  p.add_argument("--eval-per-task", type=int, default=8, help="held-out records per task")
  p.add_argument("--min-len", type=int, default=128, help="shortest prompt (tokens)")
  p.add_argument("--max-len", type=int, default=448, help="longest prompt (tokens)")
  p.add_argument("--templates", default="0,1", help="wordings used (2 is the held-out one)")
  p.add_argument("--random-wordings", type=float, default=0.0, metavar="SHARE",
                 help="share of records worded like the backbone's pretraining (many fixed "
                      "and random wordings, never the held-out one) instead of --templates")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the generated records (the same seed, the same files)")
  p.add_argument("--tasks", default=",".join(TASKS),
                 help=f"comma-separated tasks (default the five; also RULER's families "
                      f"{', '.join(FAMILY_TASKS)})")
  args = p.parse_args(argv)
  tasks = parse_tasks(args.tasks)
  if args.per_task < 1 or args.eval_per_task < 0:
    raise ElasticJaxError("--per-task must be >= 1 and --eval-per-task >= 0")
  if not 0.0 <= args.random_wordings <= 1.0:
    raise ElasticJaxError(f"--random-wordings {args.random_wordings}: a share in [0, 1]")
  try:
    templates = tuple(int(t) for t in args.templates.split(","))
  except ValueError:
    raise ElasticJaxError(f"--templates {args.templates}: a comma-separated list of 0, 1, "
                          "2") from None
  variant = Variant("train", templates, args.min_len, args.max_len)
  n = write_jsonl(os.path.join(args.out, "train.jsonl"), variant, args.per_task, args.seed,
                  tasks, random_wordings=args.random_wordings)
  worded = (f"templates {list(templates)}" if not args.random_wordings else
            f"templates {list(templates)}, {args.random_wordings:.0%} pretraining wordings")
  print(f"mixture: {n} training records ({', '.join(tasks)}; prompts of {args.min_len}-"
        f"{args.max_len} tokens, {worded}) in {args.out}/train.jsonl")
  if args.eval_per_task:
    m = write_jsonl(os.path.join(args.out, "eval.jsonl"), variant, args.eval_per_task,
                    args.seed + 1, tasks, random_wordings=args.random_wordings)
    print(f"mixture: {m} held-out records in {args.out}/eval.jsonl")
  return 0


if __name__ == "__main__":
  import sys
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
