"""RULER's synthetic long-context tasks, generated locally for any tokenizer and any length.

RULER (NVIDIA/RULER; Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", 2024) probes a model at a chosen context length with synthetic tasks whose
haystack is sized, in the model's own tokens, to fill that length. This module rebuilds the
eleven synthetic tasks of RULER's standard configuration without downloads or extra packages:

  niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery   needle in a haystack
  vt    variable tracking: follow a chain of ``VAR X = VAR Y`` assignments
  cwe   common words extraction: the 10 most frequent words of a numbered list
  fwe   frequent words extraction: the 3 most frequent coded words of a Zipf-distributed text

The task definitions, prompt templates, answer prefixes, haystack and needle kinds, generation
budgets and scoring rules follow RULER's data and evaluation scripts; the code is written here.
RULER's question-answering tasks (qa_1, qa_2) need SQuAD / HotpotQA files and are not included.

Where this module departs from RULER, and why:

* Essay haystack. RULER uses Paul Graham's essays, which cannot be shipped. The "essay" haystack
  here is plain essay-like prose produced by a small seeded grammar (``ruler_data/
  essay_grammar.txt``); like RULER's, it is the same text for every sample, cut to a number of
  words and split into sentences, with needles placed between sentences at RULER's 40 depths.
* Word lists. RULER draws keys and words from the ``wonderwords`` package (and a large English
  word file for very long lists). Here they come from ``ruler_data/{nouns,adjectives,verbs}.txt``
  (about 3,000 words); when a common-words list needs more distinct words than that, deterministic
  pronounceable pseudo-words extend it.
* Length precision. RULER sizes the haystack in whole units (a five-sentence noise block, a
  distractor needle line). To land every sample within 2% of the requested length even at short
  lengths, the noise haystack is sized in single sentences (its last line may hold fewer than
  five), and the needle haystack (niah_multikey_2, niah_multikey_3), whose lines can exceed 2% of
  a short context, is topped up with noise sentences in a final line when whole lines leave a gap
  of more than 1% of the length.
* Uniqueness. Keys, values and distractors within a sample are drawn without repeats, so that no
  distractor can shadow the asked key or value (RULER leaves such collisions to chance).
* Cosmetics. Empty stretches between adjacent needles do not leave double spaces, and the
  variable-tracking chain lines carry no trailing space.

Every sample is sized so that its prompt (``input + answer_prefix``, tokenized without special
tokens) plus the task's generation budget is at most the requested length, and as large as the
haystack allows (RULER's criterion); ``Sample.length`` reports that sum. The prompt is plain text:
a chat template, if any, is the caller's to apply, with the answer prefix appended after the
assistant turn starts, as RULER does.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import random
import re
import string
import uuid
from pathlib import Path

from elastic_jax.errors import ElasticJaxError

__all__ = ["TASKS", "Sample", "TaskSpec", "generate", "score", "string_match_all",
           "string_match_part"]

_DATA = Path(__file__).resolve().parent / "ruler_data"

# RULER's "noise" haystack: these five sentences, repeated, one block a line.
_NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
                    "Here we go.", "There and back again.")
_NOISE_LINE = " ".join(_NOISE_SENTENCES)

# RULER's needle depths for sentence-structured haystacks: 40 evenly spaced percentages.
_DEPTHS = tuple(round(100 * i / 39) for i in range(40))

_NIAH_NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
_NIAH_PLURAL = (
    "Some special magic {kinds} are hidden within the following text. Make sure to memorize it."
    " I will quiz you about the {kinds} afterwards.\n{context}\nWhat are all the special magic"
    " {kinds} for {query} mentioned in the provided text?",
    " The special magic {kinds} for {query} mentioned in the provided text are")
# RULER's wording when exactly one value is asked for.
_NIAH_SINGULAR = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it."
    " I will quiz you about the {kind} afterwards.\n{context}\nWhat is the special magic"
    " {kind} for {query} mentioned in the provided text?",
    " The special magic {kind} for {query} mentioned in the provided text is")
_VT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text"
    " above.",
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v}"
    " variables are assigned the value {query}, they are: ")
_CWE = (
    "Below is a numbered list of words. In these words, some appear more often than others."
    " Memorize the ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most"
    " common words in the above list?",
    " Answer: The top {num_cw} words that appear most often in the list are:")
_FWE = (
    "Read the following coded text and track the frequency of each coded word. Find the three"
    " most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation."
    " Please ignore the dots '....'. What are the three most frequently appeared words in the"
    " above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:")

_VT_DEMO_TOKENS = 500     # RULER's in-context example for vt: a prompt of at most 500 tokens
_CWE_SHORT = 4096         # below this length RULER's cwe uses fewer repeats (6 and 1, not 30/3)
_FWE_WORD_LEN = 6         # letters per coded word
_FWE_TOKENS_PER_WORD = 50  # fwe vocabulary size = (length - generation budget) // this


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One RULER task configuration (RULER's synthetic.yaml and its per-family constants).

  `family` picks the generator; the fields after `metric` are that family's arguments and are
  ignored by the others. `metric` names the scorer: "all" (every reference must appear) or
  "part" (any reference is enough).
  """
  family: str                  # niah | variable_tracking | common_words_extraction | ...
  max_new_tokens: int          # RULER's tokens_to_generate, reserved inside the requested length
  metric: str = "all"          # all | part
  haystack: str | None = None  # niah: noise | essay | needle; vt: noise
  needle_k: str = "words"      # niah key kind: words | numbers | uuids
  needle_v: str = "numbers"    # niah value kind: words | numbers | uuids
  num_needle_k: int = 1        # niah keys hidden (raised to num_needle_q when smaller, as RULER)
  num_needle_v: int = 1        # niah values per key
  num_needle_q: int = 1        # niah keys asked for
  num_chains: int = 1          # vt chains of assignments
  num_hops: int = 4            # vt assignments after the first (num_hops + 1 variables a chain)
  freq_cw: int = 30            # cwe repeats of each common word (lengths >= 4096)
  freq_ucw: int = 3            # cwe repeats of each uncommon word (lengths >= 4096)
  num_cw: int = 10             # cwe common words asked for
  alpha: float = 2.0           # fwe Zipf exponent


def _niah(**kw) -> TaskSpec:
  return TaskSpec(family="niah", max_new_tokens=128, **kw)


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": _niah(haystack="noise"),
    "niah_single_2": _niah(haystack="essay"),
    "niah_single_3": _niah(haystack="essay", needle_v="uuids"),
    "niah_multikey_1": _niah(haystack="essay", num_needle_k=4),
    "niah_multikey_2": _niah(haystack="needle"),
    "niah_multikey_3": _niah(haystack="needle", needle_k="uuids", needle_v="uuids"),
    "niah_multivalue": _niah(haystack="essay", num_needle_v=4),
    "niah_multiquery": _niah(haystack="essay", num_needle_q=4),
    "vt": TaskSpec(family="variable_tracking", max_new_tokens=30, haystack="noise"),
    "cwe": TaskSpec(family="common_words_extraction", max_new_tokens=120),
    "fwe": TaskSpec(family="freq_words_extraction", max_new_tokens=50),
}


@dataclasses.dataclass(frozen=True)
class Sample:
  """One generated example.

  `input` is the prompt before any chat template and `answer_prefix` the text the answer starts
  with (RULER appends it after the model's turn begins). `outputs` are the reference strings.
  `length` counts the tokens of `input + answer_prefix` (no special tokens) plus
  `max_new_tokens`: it is at most the requested length.
  """
  task: str
  index: int
  input: str
  answer_prefix: str
  outputs: list[str]
  length: int
  max_new_tokens: int


# ---------------------------------------------------------------------------------------------
# Word lists and the essay grammar (package data under ruler_data/).


def _read_lines(name: str) -> list[str]:
  text = (_DATA / name).read_text(encoding="utf-8")
  return [line.strip() for line in text.splitlines()
          if line.strip() and not line.lstrip().startswith("#")]


@functools.lru_cache(maxsize=None)
def _words() -> dict[str, tuple[str, ...]]:
  """The shipped word lists: nouns, adjectives, verbs, and `all` (their sorted union)."""
  lists = {name: tuple(_read_lines(f"{name}.txt")) for name in ("nouns", "adjectives", "verbs")}
  lists["all"] = tuple(sorted(set(lists["nouns"]) | set(lists["adjectives"])
                              | set(lists["verbs"])))
  return lists


@functools.lru_cache(maxsize=None)
def _pseudo_words(count: int) -> tuple[str, ...]:
  """`count` distinct pronounceable non-words (consonant-vowel syllables), fixed for all runs.

  They extend the common-words list past the shipped vocabulary. Calls with a larger count
  return the same words first, so the list is stable as it grows.
  """
  rng = random.Random("elastic_jax/ruler/pseudo-words")
  real = set(_words()["all"])
  seen: set[str] = set()
  out: list[str] = []
  while len(out) < count:
    syllables = 3 if len(out) < 150_000 else 4
    word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(syllables))
    if word not in seen and word not in real:
      seen.add(word)
      out.append(word)
  return tuple(out)


# Regular English inflection for the essay grammar; its file spells out the irregular forms.


def _plural(word: str) -> str:
  if word.endswith(("s", "x", "z", "ch", "sh")):
    return word + "es"
  if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u"):
    return word[:-1] + "ies"
  return word + "s"


def _past(verb: str) -> str:
  if verb.endswith("e"):
    return verb + "d"
  if verb.endswith("y") and verb[-2:-1] not in ("a", "e", "i", "o", "u"):
    return verb[:-1] + "ied"
  return verb + "ed"


def _gerund(verb: str) -> str:
  if verb.endswith("ie"):
    return verb[:-2] + "ying"
  if verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")):
    return verb[:-1] + "ing"
  return verb + "ing"


def _article(word: str) -> str:
  """ "a" or "an" before `word`, by its first sound for the words the grammar uses."""
  if word.startswith(("uni", "use", "usu", "eu", "one")):
    return "a"
  if word.startswith(("hon", "hour", "heir")):
    return "an"
  return "an" if word[0] in "aeiou" else "a"


@functools.lru_cache(maxsize=None)
def _grammar() -> dict[str, list]:
  """Parse essay_grammar.txt into word forms per slot and the sentence templates."""
  sections: dict[str, list[str]] = {}
  current = None
  for line in _read_lines("essay_grammar.txt"):
    head = re.fullmatch(r"\[(\w+)\]", line)
    if head:
      current = sections.setdefault(head.group(1), [])
    elif current is not None:
      current.extend([line] if current is sections.get("templates") else line.split())
  nouns = list(dict.fromkeys(sections["nouns"]))
  verbs = list(dict.fromkeys(sections["verbs"]))
  g: dict[str, list] = {"n": [], "ns": [], "v": [], "vs": [], "ved": [], "ving": []}
  for entry in nouns:
    singular, _, plural = entry.partition(":")
    g["n"].append(singular)
    g["ns"].append(plural or _plural(singular))
  for entry in verbs:
    base, past, ing = (entry.split(":") + ["", ""])[:3]
    g["v"].append(base)
    g["vs"].append(_plural(base))
    g["ved"].append(past or _past(base))
    g["ving"].append(ing or _gerund(base))
  g["a"] = list(dict.fromkeys(sections["adjectives"]))
  g["adv"] = list(dict.fromkeys(sections["adverbs"]))
  g["num"] = list(dict.fromkeys(sections["numbers"]))
  g["templates"] = sections["templates"]
  return g


class _Essay:
  """The essay haystack: one endless, fixed stream of grammar sentences, extended on demand."""

  def __init__(self):
    self._rng = random.Random("elastic_jax/ruler/essay")
    self._words: list[str] = []
    self._sentences: list[str] = []
    self._ends: list[int] = []   # word count after each sentence

  def _sentence(self) -> str:
    g = _grammar()
    rng = self._rng

    def fill(match):
      slot = match.group(1)
      if slot in ("a_n", "a_a"):
        word = rng.choice(g[slot[-1]])
        return f"{_article(word)} {word}"
      return rng.choice(g[slot])

    text = re.sub(r"\{(\w+)\}", fill, rng.choice(g["templates"]))
    return text[0].upper() + text[1:]

  def sentences(self, num_words: int) -> list[str]:
    """The first `num_words` words as sentences; the last one may be cut short (as RULER's)."""
    while len(self._words) < num_words:
      for _ in range(500):
        sentence = self._sentence()
        self._sentences.append(sentence)
        self._words.extend(sentence.split(" "))
        self._ends.append(len(self._words))
    whole = bisect.bisect_right(self._ends, num_words)
    out = self._sentences[:whole]
    start = self._ends[whole - 1] if whole else 0
    if start < num_words:
      out.append(" ".join(self._words[start:num_words]))
    return out


_ESSAY = _Essay()


# ---------------------------------------------------------------------------------------------
# Shared pieces of the generators.


def _noise_lines(num_sentences: int) -> list[str]:
  """RULER's noise haystack, `num_sentences` sentences long, five sentences a line."""
  full, rest = divmod(num_sentences, len(_NOISE_SENTENCES))
  lines = [_NOISE_LINE] * full
  if rest:
    lines.append(" ".join(_NOISE_SENTENCES[:rest]))
  return lines


def _interleave(rng: random.Random, lines: list[str], items: list[str]) -> list[str]:
  """`items`, in order, spread among `lines` at uniformly random slots (RULER's line haystacks)."""
  total = len(lines) + len(items)
  slots = set(rng.sample(range(total), len(items)))
  lines_it, items_it = iter(lines), iter(items)
  return [next(items_it) if i in slots else next(lines_it) for i in range(total)]


def _at_depths(rng: random.Random, sentences: list[str], items: list[str]) -> str:
  """`items` placed between sentences at depths drawn from RULER's 40 (without repeats)."""
  cuts = sorted(len(sentences) * d // 100 for d in rng.sample(_DEPTHS, len(items)))
  parts, start = [], 0
  for cut, item in zip(cuts, items):
    if cut > start:
      parts.append(" ".join(sentences[start:cut]))
    parts.append(item)
    start = cut
  if start < len(sentences):
    parts.append(" ".join(sentences[start:]))
  return " ".join(parts)


def _draw(rng: random.Random, kind: str, used: set[str]) -> str:
  """A fresh random key or value of `kind` (RULER's forms), never one already in `used`."""
  while True:
    if kind == "numbers":
      value = str(rng.randint(10**6, 10**7 - 1))
    elif kind == "words":
      words = _words()
      value = f"{rng.choice(words['adjectives'])}-{rng.choice(words['nouns'])}"
    elif kind == "uuids":
      value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    else:
      raise ValueError(f"unknown needle kind {kind!r}")
    if value not in used:
      used.add(value)
      return value


def _names(rng: random.Random, count: int, letters: int) -> list[str]:
  """`count` distinct upper-case variable names of `letters` letters."""
  out: list[str] = []
  while len(out) < count:
    name = "".join(rng.choices(string.ascii_uppercase, k=letters))
    if name not in out:
      out.append(name)
  return out


# ---------------------------------------------------------------------------------------------
# The four task families. Each builder turns a haystack size `n` (in its own units) into a
# prompt, deterministically for its sample seed; everything but the haystack (keys, values,
# chains, the question) is drawn first, so it stays the same while the size is searched.


class _Niah:
  """Needle in a haystack: hide "One of the special magic ... for KEY is: VALUE." sentences."""

  def __init__(self, spec: TaskSpec, shared: dict, seed: str):
    self.spec, self.seed = spec, seed
    self.n_min = 0  # units: noise sentences, essay words or distractor needle lines
    self.pads = spec.haystack == "needle"

  def build(self, n: int, pad: int = 0) -> tuple[str, str, list[str]]:
    spec, rng, used = self.spec, random.Random(self.seed), set()
    num_k = max(spec.num_needle_k, spec.num_needle_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
      keys.append(_draw(rng, spec.needle_k, used))
      values.append([_draw(rng, spec.needle_v, used) for _ in range(spec.num_needle_v)])
      needles += [_NIAH_NEEDLE.format(kinds=spec.needle_v, key=keys[-1], value=value)
                  for value in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), spec.num_needle_q)
    queries = [keys[i] for i in asked]
    answers = [value for i in asked for value in values[i]]
    query = (queries[0] if len(queries) == 1
             else ", ".join(queries[:-1]) + ", and " + queries[-1])

    if spec.haystack == "essay":
      context = _at_depths(rng, _ESSAY.sentences(n), needles)
    else:
      if spec.haystack == "noise":
        lines = _noise_lines(n)
      else:
        lines = [_NIAH_NEEDLE.format(kinds=spec.needle_v, key=_draw(rng, spec.needle_k, used),
                                     value=_draw(rng, spec.needle_v, used)) for _ in range(n)]
      lines = _interleave(rng, lines, needles)
      if pad:
        lines += [" ".join(_NOISE_SENTENCES[i % len(_NOISE_SENTENCES)] for i in range(pad))]
      context = "\n".join(lines)

    if len(answers) == 1:
      template, prefix = _NIAH_SINGULAR
      kind = spec.needle_v[:-1]
      return (template.format(kind=kind, context=context, query=query),
              prefix.format(kind=kind, query=query), answers)
    template, prefix = _NIAH_PLURAL
    return (template.format(kinds=spec.needle_v, context=context, query=query),
            prefix.format(kinds=spec.needle_v, query=query), answers)


class _VariableTracking:
  """Variable tracking: chains "VAR A = 12345", "VAR B = VAR A", ... hidden in noise; name all
  variables holding the value. Preceded, as in RULER, by one solved example (3-letter names)."""

  pads = False

  def __init__(self, spec: TaskSpec, shared: dict, seed: str):
    self.spec, self.seed = spec, seed
    self.demo_units = shared.get("demo_units", 0)
    self.n_min = 0  # units: noise sentences

  @staticmethod
  def prepare(spec: TaskSpec, length: int, count, seed: int) -> dict:
    """Size the noise of the solved example once per call, to RULER's 500-token budget."""
    probe = _VariableTracking(spec, {}, f"{seed}/vt-demo")

    def measure(units):
      return count(probe._demo(random.Random(probe.seed), units))

    found = _fit(measure, 0, _VT_DEMO_TOKENS)
    return {"demo_units": found[0] if found else 0}

  def _chains(self, rng, letters):
    spec, hops = self.spec, self.spec.num_hops
    names = _names(rng, (hops + 1) * spec.num_chains, letters)
    chains, values = [], []
    for c in range(spec.num_chains):
      chain_names = names[c * (hops + 1):(c + 1) * (hops + 1)]
      values.append(str(rng.randint(10000, 99999)))
      lines = [f"VAR {chain_names[0]} = {values[-1]}"]
      lines += [f"VAR {b} = VAR {a}" for a, b in zip(chain_names, chain_names[1:])]
      chains.append((chain_names, lines))
    return chains, values

  def _prompt(self, rng, chains, value, noise_units):
    lines = _noise_lines(noise_units)
    for _, chain_lines in chains:
      lines = _interleave(rng, lines, chain_lines)
    template, prefix = _VT
    num_v = self.spec.num_hops + 1
    return (template.format(context="\n".join(lines), query=value),
            prefix.format(num_v=num_v, query=value))

  def _demo(self, rng, units):
    chains, values = self._chains(rng, 3)
    text, prefix = self._prompt(rng, chains, values[0], units)
    return text + prefix + " ".join(chains[0][0]) + "\n"

  def build(self, n: int, pad: int = 0) -> tuple[str, str, list[str]]:
    rng = random.Random(self.seed)
    chains, values = self._chains(rng, 5)
    demo = self._demo(rng, self.demo_units)
    text, prefix = self._prompt(rng, chains, values[0], n)
    return demo + "\n" + text, prefix, list(chains[0][0])


class _CommonWords:
  """Common words extraction: a numbered word list where `num_cw` words repeat more often;
  name them. Preceded, as in RULER, by one solved example."""

  pads = False

  def __init__(self, spec: TaskSpec, shared: dict, seed: str):
    self.spec, self.seed, self.short = spec, seed, shared["short"]
    # units: distinct words in the list; at least one less common than the common ones, so
    # that the question has a non-trivial answer (RULER's own search has no such floor).
    self.n_min = spec.num_cw + 1

  @staticmethod
  def prepare(spec: TaskSpec, length: int, count, seed: int) -> dict:
    return {"short": length < _CWE_SHORT}

  def _listing(self, rng, words, common_repeats, other_repeats):
    common = words[:self.spec.num_cw]
    items = common * common_repeats + words[self.spec.num_cw:] * other_repeats
    rng.shuffle(items)
    return " ".join(f"{i}. {w}" for i, w in enumerate(items, 1)), common

  def build(self, n: int, pad: int = 0) -> tuple[str, str, list[str]]:
    spec, rng = self.spec, random.Random(self.seed)
    # RULER's repeats: (example words, example repeats common/other, task repeats common/other)
    if self.short:
      demo_words, demo_reps, reps = 20, (3, 1), (6, 1)
    else:
      demo_words, demo_reps, reps = 40, (10, 3), (spec.freq_cw, spec.freq_ucw)
    real = _words()["all"]
    demo_list = rng.sample(real, demo_words)
    taken = set(demo_list)
    pool = [w for w in real if w not in taken]
    if n > len(pool):
      pool += _pseudo_words(n - len(pool))
    words = rng.sample(pool, n)
    template, prefix = _CWE
    demo_ctx, demo_common = self._listing(rng, demo_list, *demo_reps)
    context, common = self._listing(rng, words, *reps)
    demo = (template.format(num_cw=spec.num_cw, context=demo_ctx)
            + prefix.format(num_cw=spec.num_cw) + " "
            + " ".join(f"{i}. {w}" for i, w in enumerate(demo_common, 1)))
    return (demo + "\n" + template.format(num_cw=spec.num_cw, context=context),
            prefix.format(num_cw=spec.num_cw), list(common))


def _zeta(alpha: float) -> float:
  """Riemann zeta(alpha) for alpha > 1 (a direct sum with an Euler-Maclaurin tail)."""
  terms = 1000
  head = sum(k ** -alpha for k in range(1, terms))
  return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha


class _FreqWords:
  """Frequent words extraction: coded words with Zipf counts (the top one is "..."); name the
  three most frequent coded words."""

  pads = False

  def __init__(self, spec: TaskSpec, shared: dict, seed: str):
    self.spec, self.seed, self.vocab_size = spec, seed, shared["vocab_size"]
    z = _zeta(spec.alpha)
    self._weights = [k ** -spec.alpha / z for k in range(1, self.vocab_size + 1)]
    self.n_min = next(n for n in range(1, 10**6) if self.valid(n))  # units: Zipf total

  @staticmethod
  def prepare(spec: TaskSpec, length: int, count, seed: int) -> dict:
    vocab_size = (length - spec.max_new_tokens) // _FWE_TOKENS_PER_WORD
    if vocab_size < 5:
      need = spec.max_new_tokens + 5 * _FWE_TOKENS_PER_WORD
      raise ElasticJaxError(f"RULER task 'fwe' needs a length of at least {need} tokens (its"
                            f" vocabulary is (length - {spec.max_new_tokens}) //"
                            f" {_FWE_TOKENS_PER_WORD} words, at least 5); got {length}")
    return {"vocab_size": vocab_size}

  def counts(self, n: int) -> list[int]:
    return [int(n * w) for w in self._weights]

  def valid(self, n: int) -> bool:
    """The three coded words after "..." must each beat every other coded word."""
    c = self.counts(n)
    return c[3] > c[4]

  def build(self, n: int, pad: int = 0) -> tuple[str, str, list[str]]:
    rng = random.Random(self.seed)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < self.vocab_size:
      word = "".join(rng.choices(string.ascii_lowercase, k=_FWE_WORD_LEN))
      if word not in seen:
        seen.add(word)
        vocab.append(word)
    vocab[0] = "..."  # RULER treats the top-ranked word as noise
    text = [w for w, c in zip(vocab, self.counts(n)) for _ in range(c)]
    rng.shuffle(text)
    template, prefix = _FWE
    return template.format(context=" ".join(text)), prefix, vocab[1:4]


_FAMILIES = {
    "niah": _Niah,
    "variable_tracking": _VariableTracking,
    "common_words_extraction": _CommonWords,
    "freq_words_extraction": _FreqWords,
}


# ---------------------------------------------------------------------------------------------
# Sizing and generation.


def _fit(measure, n_min: int, budget: int, hint: int | None = None):
  """The largest n >= n_min with measure(n) <= budget, as (n, measure(n)); None when even n_min
  is over. measure is near-linear and almost monotone in n (haystack tokens), so this brackets
  the answer by extrapolation, then closes in by interpolation, falling back to bisection when
  interpolation keeps landing on one side: a handful of tokenizations instead of a full binary
  search over the whole range."""
  seen: dict[int, int] = {}

  def m(n):
    if n not in seen:
      seen[n] = measure(n)
    return seen[n]

  if m(n_min) > budget:
    return None
  # Every haystack unit costs at least one token, so no answer lies beyond n_min + budget: the
  # search never builds a larger haystack (a tokenizer that encodes it to nothing would
  # otherwise grow it without bound).
  n_max = n_min + max(budget, 1)
  lo, hi = n_min, None
  guess = hint if hint is not None and hint > n_min else n_min + 64
  side = streak = 0
  for _ in range(200):
    fits = m(guess) <= budget
    if fits:
      lo = guess
    else:
      hi = guess
    streak = streak + 1 if fits == side else 1
    side = fits
    if hi is not None and hi - lo <= 1:
      return lo, m(lo)
    if hi is None:
      if lo >= n_max:
        raise ElasticJaxError("the RULER haystack does not grow in tokens: the tokenizer "
                              "encodes its text to (almost) nothing")
      rate = max((m(lo) - m(n_min)) / (lo - n_min), 1e-6)
      step = max(1, int((budget - m(lo)) / rate) + 1)
      guess = min(lo + step * 2 ** (streak - 1), n_max)
    else:
      if streak >= 2:
        guess = (lo + hi) // 2
      else:
        span = max(m(hi) - m(lo), 1)
        guess = lo + int((budget - m(lo)) * (hi - lo) / span)
      guess = min(max(guess, lo + 1), hi - 1)
  raise RuntimeError("the RULER haystack search did not converge")


def _spec(task: str) -> TaskSpec:
  if task not in TASKS:
    raise ElasticJaxError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
  return TASKS[task]


def _counter(tokenizer):
  """Token count of a text, without special tokens (RULER's measure)."""
  def count(text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
  return count


def generate(task: str, tokenizer, length: int, num_samples: int, seed: int = 0) -> list[Sample]:
  """`num_samples` samples of RULER task `task`, each sized to `length` tokens of `tokenizer`.

  `tokenizer` is a Hugging Face tokenizer (anything called as `tokenizer(text,
  add_special_tokens=False)` returning "input_ids"). Each sample's prompt plus the task's
  generation budget fits `length` and fills it as far as the haystack's granularity allows
  (within 2% of it in practice). The haystack size is searched per sample with a few
  tokenizations of the whole prompt, the previous sample's size as the first guess. Samples
  are a pure function of (task, tokenizer, length, index, seed). Raises ElasticJaxError for an
  unknown task or a length too small for the task (the message gives the smallest that works).
  """
  spec = _spec(task)
  if isinstance(length, bool) or not isinstance(length, int) or length < 1:
    raise ElasticJaxError(f"RULER length must be a positive integer; got {length!r}")
  if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
    raise ElasticJaxError(f"RULER num_samples must be a non-negative integer; got {num_samples!r}")
  family = _FAMILIES[spec.family]
  count = _counter(tokenizer)
  budget = length - spec.max_new_tokens
  shared = family.prepare(spec, length, count, seed) if hasattr(family, "prepare") else {}
  samples, hint = [], None
  for index in range(num_samples):
    builder = family(spec, shared, f"{seed}/{task}/{index}")

    def measure(n, pad=0):
      text, prefix, _ = builder.build(n, pad)
      return count(text + prefix)

    found = _fit(measure, builder.n_min, budget, hint)
    if found is None:
      need = measure(builder.n_min) + spec.max_new_tokens
      raise ElasticJaxError(
          f"RULER task {task!r} needs a length of at least {need} tokens with this tokenizer"
          f" (its prompt with the smallest haystack plus {spec.max_new_tokens} generated"
          f" tokens); got {length}")
    n, used = found
    hint = n
    if hasattr(builder, "valid") and not builder.valid(n):
      while not builder.valid(n):
        n -= 1
      used = measure(n)
    pad = 0
    if builder.pads and budget - used > 0.01 * length:
      pad, used = _fit(lambda p: measure(n, p), 0, budget)
    text, prefix, outputs = builder.build(n, pad)
    samples.append(Sample(task=task, index=index, input=text, answer_prefix=prefix,
                          outputs=outputs, length=used + spec.max_new_tokens,
                          max_new_tokens=spec.max_new_tokens))
  return samples


# ---------------------------------------------------------------------------------------------
# Scoring (RULER's evaluation: strip, map control characters to newlines, case-insensitive
# containment of each reference).


def _postprocess(prediction: str) -> str:
  return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def _check(preds, refs_list) -> None:
  if len(preds) != len(refs_list):
    raise ElasticJaxError(f"RULER scoring got {len(preds)} predictions for {len(refs_list)}"
                          " reference lists")
  if not preds:
    raise ElasticJaxError("RULER scoring got no predictions")
  if any(len(refs) == 0 for refs in refs_list):
    raise ElasticJaxError("RULER scoring got an empty reference list")


def string_match_all(preds: list[str], refs_list: list[list[str]]) -> float:
  """RULER's "all" metric: per sample, the fraction of references contained in the prediction
  (case-insensitive); the mean over samples, in percent, rounded to 2 decimals."""
  _check(preds, refs_list)
  total = sum(sum(r.lower() in p.lower() for r in refs) / len(refs)
              for p, refs in zip(preds, refs_list))
  return round(100.0 * total / len(preds), 2)


def string_match_part(preds: list[str], refs_list: list[list[str]]) -> float:
  """RULER's "part" metric: per sample, 1 if any reference is contained in the prediction
  (case-insensitive); the mean over samples, in percent, rounded to 2 decimals."""
  _check(preds, refs_list)
  total = sum(max(r.lower() in p.lower() for r in refs) for p, refs in zip(preds, refs_list))
  return round(100.0 * total / len(preds), 2)


def score(task: str, predictions: list[str], samples: list[Sample]) -> float:
  """Score model outputs for `samples` of `task` as RULER does: post-process each prediction
  (strip; control characters become newlines), then apply the task's metric."""
  spec = _spec(task)
  if any(s.task != task for s in samples):
    raise ElasticJaxError(f"RULER scoring for {task!r} got samples of another task")
  metric = string_match_all if spec.metric == "all" else string_match_part
  if len(predictions) != len(samples):
    raise ElasticJaxError(f"RULER scoring got {len(predictions)} predictions for"
                          f" {len(samples)} samples")
  return metric([_postprocess(p) for p in predictions], [s.outputs for s in samples])
