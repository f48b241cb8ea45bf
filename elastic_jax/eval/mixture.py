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

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(4)
PUNCT = (".", ",", ":", "?", "=", "->", ";")
NUM_NAMES = 200                  # n0 .. n199: keys, variables, pattern symbols
NUM_NUMBERS = 200                # 0 .. 199: values
NUM_FILLER = 300
TASKS = ("kv", "hop", "summary", "pattern", "fewshot")
TASK_TYPE = {"kv": "Single QA", "hop": "MultiHop QA", "summary": "Summarization",
             "pattern": "Code", "fewshot": "In-Context Learning", **families.FAMILY_TYPE}
ALL_TASKS = TASKS + families.FAMILY_TASKS     # the five and RULER's families
SENSITIVE = ("kv", "hop")        # of the five; the families (eval/families.py) are all sensitive
TRAIN_TEMPLATES = (0, 1)
HELDOUT_TEMPLATE = 2
FACT_ZONE = 0.8                  # sensitive facts lie in the first 80% of the context

# Per task and template: the fact / marker wording and the question. {k} {v} {a} {b} are
# filled with names and numbers.
TEMPLATES = {
    "kv": (("the value of key {k} is {v} .", "what is the value of key {k} ?"),
           ("key {k} has value {v} .", "which value does key {k} have ?"),
           ("remember that {k} maps to {v} .", "tell me what {k} maps to .")),
    "hop": (("{a} is equal to {b} .", "follow {a} to its number ."),
            ("set {a} = {b} ;", "what number does {a} reach ?"),
            ("{a} links to {b} .", "which number is {a} linked to in the end ?")),
    "summary": (("passage :", "summarize the passage :"),
                ("notes :", "give the short summary :"),
                ("text :", "in brief :")),
    "pattern": (("code :", "continue :"),
                ("def f :", "next tokens :"),
                ("loop :", "what comes next ?")),
    "fewshot": (("examples : {k} -> {v} ,", "{k} ->"),
                ("map : {k} gives {v} ;", "{k} gives"),
                ("table : {k} is {v} ,", "{k} is")),
}


# The backbone's pretraining wordings (repro/pretrain.py): the training templates 0 and 1 and
# many more, with the key before the value and after it, so that the backbone learns to bind a
# key to its value rather than one wording. Facts and questions of a task combine freely
# (fewshot's question is its pair up to the value). The held-out template 2 is never among
# them: its wording is unseen by the backbone as well as by the routers (its words occur in
# other wordings). `check_wordings` keeps it so.
PRETRAIN_FACTS = {
    "kv": ("the value of key {k} is {v} .", "key {k} has value {v} .", "{k} = {v} ;",
           "{k} : {v} .", "the number for {k} is {v} .", "{k} stores {v} .",
           "item {k} holds {v} .", "{k} is set to {v} .", "let {k} be {v} .",
           "entry {k} reads {v} .", "the code of {k} is {v} .", "note that {k} is {v} .",
           "{k} costs {v} .", "record {k} with {v} .",
           "{v} is the value of key {k} .", "{v} belongs to {k} .", "{v} is stored in {k} .",
           "the number {v} goes with {k} .", "write {v} for {k} .", "{v} : value of {k} ."),
    "hop": ("{a} is equal to {b} .", "set {a} = {b} ;", "{a} points to {b} .",
            "let {a} be {b} .", "{a} becomes {b} .", "{a} is {b} .", "{a} takes {b} .",
            "{a} copies {b} .", "{a} := {b} ;", "{a} refers to {b} .",
            "assign {b} to {a} .", "{b} is assigned to {a} .", "{b} goes into {a} ."),
    "summary": ("passage :", "notes :", "story :", "report :", "article :", "section :",
                "news :", "memo :", "entry :", "letter :"),
    "pattern": ("code :", "def f :", "sequence :", "line :", "cycle :", "repeat :",
                "list :", "rows :", "series :"),
    "fewshot": ("examples : {k} -> {v} ,", "map : {k} gives {v} ;", "pairs : {k} = {v} ,",
                "data : {k} yields {v} ;", "list : {k} becomes {v} ,", "rules : {k} : {v} ;",
                "cases : {k} turns into {v} ,", "samples : {k} => {v} ;"),
}
PRETRAIN_QUESTIONS = {
    "kv": ("what is the value of key {k} ?", "which value does key {k} have ?",
           "what does {k} hold ?", "{k} = ?", "give the number of {k} .",
           "what number goes with {k} ?", "value of {k} ?", "look up {k} :",
           "which number is stored in {k} ?", "report the value of {k} .",
           "what is {k} set to ?", "find the value for key {k} ."),
    "hop": ("follow {a} to its number .", "what number does {a} reach ?", "resolve {a} .",
            "what is {a} in the end ?", "trace {a} to a number .", "where does {a} lead ?",
            "find the final number of {a} .", "evaluate {a} :", "chase {a} ."),
    "summary": ("summarize the passage :", "give the short summary :", "headline :",
                "title :", "the summary :", "sum up :", "short version :", "gist :"),
    "pattern": ("continue :", "next tokens :", "go on :", "what follows ?", "extend :",
                "more :", "carry on :"),
}
# Words of the random wordings (`pretraining_wording`): connectors between a key and its value,
# words of questions and markers. With them, half of pretraining's wordings are random, so
# that no wording, the held-out one included, is special to the backbone.
CONNECTORS = ("then", "also", "now", "here", "we", "see", "find", "has", "with", "for", "as",
              "at", "on", "by", "from", "into", "and", "or", "so", "this", "one", "each",
              "any", "new", "old", "first", "last", "name", "field", "slot", "label", "tag",
              "put", "keep", "get", "show", "ask", "say", "know", "use")


def _template_words() -> list[str]:
  words: list[str] = []
  texts = [t for per_task in TEMPLATES.values() for pair in per_task for t in pair]
  texts += [t for d in (PRETRAIN_FACTS, PRETRAIN_QUESTIONS) for ts in d.values() for t in ts]
  texts += list(CONNECTORS)
  for text in texts:
    for w in text.replace("{", " {").split():
      if not w.startswith("{") and w not in PUNCT and w not in words:
        words.append(w)
  return words


def _filler_words(exclude: set[str]) -> list[str]:
  text = resources.files("elastic_jax.eval").joinpath("ruler_data/nouns.txt").read_text("utf-8")
  out = []
  for line in text.splitlines():
    w = line.strip()
    if w and not w.startswith("#") and w.isalpha() and w.islower() and w not in exclude:
      out.append(w)
    if len(out) == NUM_FILLER:
      return out
  raise ElasticJaxError(f"the word list holds fewer than {NUM_FILLER} filler words")


def vocabulary() -> list[str]:
  """Every token, id order: specials, punctuation, names, numbers, template words, filler."""
  names = [f"n{i}" for i in range(NUM_NAMES)]
  numbers = [str(i) for i in range(NUM_NUMBERS)]
  template = _template_words()
  head = list(SPECIALS) + list(PUNCT) + names + numbers + template
  return head + _filler_words(set(head))


VOCAB = vocabulary()
IDS = {w: i for i, w in enumerate(VOCAB)}
NAME_IDS = np.array([IDS[f"n{i}"] for i in range(NUM_NAMES)], np.int32)
NUMBER_IDS = np.array([IDS[str(i)] for i in range(NUM_NUMBERS)], np.int32)
FILLER_IDS = np.array([IDS[w] for w in VOCAB[-NUM_FILLER:]], np.int32)
DOT = IDS["."]


def encode(text: str) -> np.ndarray:
  """Token ids of whitespace-separated words (no specials); unknown words are an error."""
  try:
    return np.array([IDS[w] for w in text.split()], np.int32)
  except KeyError as e:
    raise ElasticJaxError(f"word {e.args[0]!r} is not in the mixture's vocabulary") from None


def check_tokenizer(tokenizer, where: str) -> None:
  """Refuses a tokenizer whose ids are not the mixture's (the text would turn into <unk>)."""
  vocab = tokenizer.get_vocab()
  if any(vocab.get(w) != i for i, w in enumerate(VOCAB)):
    raise ElasticJaxError(f"{where}: its tokenizer is not the task mixture's (the "
                          "reproduction's backbone, elastic_jax/repro/backbone, has it)")


def decode(ids: Sequence[int]) -> str:
  return " ".join(VOCAB[i] for i in ids if i >= len(SPECIALS))


@dataclasses.dataclass(frozen=True)
class Sample:
  """One task instance as token ids (prompt = context + question; no BOS/EOS)."""
  task: str
  template: int
  context: np.ndarray
  question: np.ndarray
  answer: np.ndarray
  # Further (question, answer) pairs on the same context (pretraining only).
  extra: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
  # How many values of the context a guess would choose among (kv: facts, hop: chains,
  # fewshot: pairs; 0 where the answer is not one of a few candidates): chance = 1/candidates.
  candidates: int = 0

  @property
  def task_type(self) -> str:
    return TASK_TYPE[self.task]

  @property
  def prompt_len(self) -> int:
    return len(self.context) + len(self.question)

  def record(self) -> dict[str, str]:
    """The train.py JSONL record (context, question, answer, task)."""
    return {"context": decode(self.context), "question": decode(self.question),
            "answer": decode(self.answer), "task": self.task_type, "name": self.task,
            "template": self.template}


def fill_template(t: str, **kw) -> np.ndarray:
  return encode(t.format(**{k: VOCAB[v] for k, v in kw.items()}))


def filler_tokens(rng: np.random.Generator, n: int, pool: np.ndarray = FILLER_IDS) -> np.ndarray:
  """n tokens of filler sentences (about 9 words each, ending with a full stop)."""
  ids = pool[rng.integers(0, len(pool), n)]
  ids[rng.random(n) < 1 / 9] = DOT
  if n:
    ids[-1] = DOT
  return ids


def insert_pieces(rng: np.random.Generator, base: np.ndarray, pieces: list[np.ndarray],
            zone: float) -> np.ndarray:
  """`pieces` inserted at distinct random sentence starts within the first `zone` of base."""
  starts = np.flatnonzero(base[:max(1, int(zone * len(base)))] == DOT) + 1
  starts = np.concatenate([[0], starts])
  at = np.sort(rng.choice(starts, size=len(pieces), replace=len(starts) < len(pieces)))
  order = rng.permutation(len(pieces))
  out, prev = [], 0
  for pos, i in zip(at, order):
    out += [base[prev:pos], pieces[i]]
    prev = pos
  out.append(base[prev:])
  return np.concatenate(out)


def distinct_ids(rng: np.random.Generator, pool: np.ndarray, n: int) -> np.ndarray:
  return pool[rng.choice(len(pool), size=n, replace=False)]


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


TEMPLATE_WORDS = tuple(_template_words())
TEMPLATE_WORD_IDS = np.array([IDS[w] for w in TEMPLATE_WORDS], np.int32)
# Filler for pretraining: the filler words and, as one word in ten, the first 33 template
# words (the evaluation templates' words of kv, hop and summary, the held-out ones among
# them), so that these words also occur where they mean nothing.
PRETRAIN_FILLER = np.concatenate([FILLER_IDS, TEMPLATE_WORD_IDS[:NUM_FILLER // 9]])


def random_words(rng: np.random.Generator, lo: int, hi: int) -> str:
  pool = TEMPLATE_WORDS
  return " ".join(pool[int(i)] for i in rng.integers(0, len(pool), int(rng.integers(lo, hi + 1))))


def random_wording(task: str, rng: np.random.Generator) -> tuple[str, str]:
  """A wording made of random words: 0-2 words, the key, 1-3 words, the value (a quarter of
  the time the value first), an end mark; a question of 1-4 words, the key, 0-2 words and a
  mark. Markers of the robust tasks: a word and a colon."""
  w = functools.partial(random_words, rng)
  end, qend = (".", ";", ",")[int(rng.integers(3))], ("?", ":", ".")[int(rng.integers(3))]
  if task in SENSITIVE:
    k, v = ("{k}", "{v}") if task == "kv" else ("{a}", "{b}")
    first, second = (k, v) if rng.random() < 0.75 else (v, k)
    return (f"{w(0, 2)} {first} {w(1, 3)} {second} {end}".strip(),
            f"{w(1, 4)} {k} {w(0, 2)} {qend}")
  if task == "fewshot":
    conn = w(1, 2)
    return f"{w(1, 1)} : {{k}} {conn} {{v}} {(',', ';')[int(rng.integers(2))]}", f"{{k}} {conn}"
  return f"{w(1, 1)} :", f"{w(1, 3)} {qend}"


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
  args = p.parse_args(argv)
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
                  random_wordings=args.random_wordings)
  worded = (f"templates {list(templates)}" if not args.random_wordings else
            f"templates {list(templates)}, {args.random_wordings:.0%} pretraining wordings")
  print(f"mixture: {n} training records ({', '.join(TASKS)}; prompts of {args.min_len}-"
        f"{args.max_len} tokens, {worded}) in {args.out}/train.jsonl")
  if args.eval_per_task:
    m = write_jsonl(os.path.join(args.out, "eval.jsonl"), variant, args.eval_per_task,
                    args.seed + 1, random_wordings=args.random_wordings)
    print(f"mixture: {m} held-out records in {args.out}/eval.jsonl")
  return 0


if __name__ == "__main__":
  import sys
  from elastic_jax.cli import run_cli
  sys.exit(run_cli(main))
