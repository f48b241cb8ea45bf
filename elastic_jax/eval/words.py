"""The task mixture's vocabulary and the pieces its samples are made of: the word-level
tokens (specials, punctuation, names, numbers, template words, filler), the tasks' template
and pretraining wordings, `Sample`, and the generators of filler, facts and random wordings.
`mixture.py` builds the five tasks from them and `families.py` RULER's families; both read
these names from here."""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources
from typing import Sequence

import numpy as np

from elastic_jax.errors import ElasticJaxError

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(4)
PUNCT = (".", ",", ":", "?", "=", "->", ";")
NUM_NAMES = 200                  # n0 .. n199: keys, variables, pattern symbols
NUM_NUMBERS = 200                # 0 .. 199: values
NUM_FILLER = 300
TASKS = ("kv", "hop", "summary", "pattern", "fewshot")
# RULER's families (eval/families.py): tasks whose head needs differ from kv's.
FAMILY_TASKS = ("mv", "mq", "vt", "cwe")
FAMILY_TYPE = {"mv": "Single QA", "mq": "Single QA", "vt": "MultiHop QA",
               "cwe": "MultiHop QA"}
TASK_TYPE = {"kv": "Single QA", "hop": "MultiHop QA", "summary": "Summarization",
             "pattern": "Code", "fewshot": "In-Context Learning", **FAMILY_TYPE}
ALL_TASKS = TASKS + FAMILY_TASKS     # the five and RULER's families
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
