"""RULER's task families on the mixture's vocabulary: tasks whose head needs differ from kv's
and hop's (issue: a static head set must then choose).

  task  RULER family        type         what the answer needs
  mv    niah_multivalue     Single QA    every value of one key, each planted apart, in order
  mq    niah_multiquery     Single QA    the values of 2-3 asked keys, in the asked order
  vt    variable tracking   MultiHop QA  every name of a chain of 3-5 assignments from a number
                                         (`set a = 42 ; set b = a ; ...`), in chain order
  cwe   common words        MultiHop QA  the 3 names that recur through a list of names, in
                                         the order of their first appearance (the authors' five
                                         task types have no aggregation type; it is sensitive)

All four are sparsity-sensitive: their evidence lies in the first 80% of the context (cwe: a
first appearance near the start of the list), so a streaming head's window cannot hold it.
Each has three wordings made of the mixture's template words (the vocabulary, and so the
shipped tokenizer, stays as it is): 0 and 1 seen, 2 held out, as for the five tasks.
"""

from __future__ import annotations

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import words as mx
from elastic_jax.eval.words import FAMILY_TASKS, FAMILY_TYPE  # noqa: F401  (the families' names)


# Per task and template: (fact or list marker, question). mq's question is (head, one key,
# joiner, tail), joined over the asked keys.
FAMILY_TEMPLATES = {
    "mv": (("the value of key {k} is {v} .", "list each value of key {k} :"),
           ("key {k} has value {v} .", "give each value key {k} has :"),
           ("remember that {k} maps to {v} .", "tell me each value {k} maps to :")),
    "mq": (("the value of key {k} is {v} .", ("what is the value of", "key {k}", "and", "?")),
           ("key {k} has value {v} .", ("which value does", "key {k}", "and", "have ?")),
           ("remember that {k} maps to {v} .", ("tell me what", "{k}", "and", "maps to ."))),
    "vt": (("set {a} = {b} ;", "which name is equal to {v} ? list each :"),
           ("{a} is equal to {b} .", "find each name equal to {v} :"),
           ("{a} links to {b} .", "show each name that links to {v} :")),
    "cwe": (("list :", "which name comes more ? list each :"),
            ("rows :", "find each name that comes more :"),
            ("data :", "show each name with more :")),
}
# Pretraining's fixed question wordings of the families (beside templates 0 and 1; never the
# held-out one); their facts are kv's and hop's pretraining facts.
FAMILY_PRETRAIN_QUESTIONS = {
    "mv": ("list each value of key {k} :", "give each value key {k} has :",
           "show each number for {k} :", "find each value of {k} :", "list each {k} holds :"),
    "mq": (("what is the value of", "key {k}", "and", "?"),
           ("which value does", "key {k}", "and", "have ?"), ("give the number of", "{k}", "and",
                                                              "."),
           ("look up", "{k}", "and", ":"), ("what does", "{k}", "and", "hold ?")),
    "vt": ("which name is equal to {v} ? list each :", "find each name equal to {v} :",
           "list each name set to {v} :", "which name holds {v} ? show each :",
           "give each name of {v} :"),
    "cwe": ("which name comes more ? list each :", "find each name that comes more :",
            "list each name that comes more :", "give each name with more :",
            "each name we see more :"),
}
COMMON = 3                       # cwe: the recurring names


def _strings(x):
  return [x] if isinstance(x, str) else [t for part in x for t in _strings(part)]


def _check_words():
  """Every word of these wordings is a template word of the mixture (so no filler word gains a
  second meaning and the vocabulary is unchanged)."""
  words = set(mx.TEMPLATE_WORDS) | set(mx.PUNCT)
  texts = _strings(list(FAMILY_TEMPLATES.values()) + list(FAMILY_PRETRAIN_QUESTIONS.values())
                   + list(CWE_MARKERS))
  for text in texts:
    for w in text.split():
      if not w.startswith("{") and w not in words:
        raise ElasticJaxError(f"the families' wording word {w!r} is not a template word of "
                              "the mixture")


def _mq_question(q, keys) -> str:
  head, one, joiner, tail = q
  return " ".join([head, f" {joiner} ".join(one.format(k="{k%d}" % i)
                                            for i in range(len(keys))), tail])


def _chain_pieces(fact, names, value, fill):
  """The facts of one chain: names[0] = value, then names[i] = names[i - 1]."""
  out = [fill(fact, a=names[0], b=value)]
  for prev, cur in zip(names[:-1], names[1:]):
    out.append(fill(fact, a=cur, b=prev))
  return out


def make(task: str, rng: np.random.Generator, length: int, template: int, *,
         wording=None, filler=None, evidence: str = "far"):
  """One sample of a family task (mixture.Sample) whose prompt has about `length` tokens.
  wording: a (fact, question) pair in place of the template's (pretraining's). evidence:
  "near" puts the facts the answer needs at the context's end (mixture.make_sample; not for
  cwe, whose evidence is the whole list)."""
  if task not in FAMILY_TASKS:
    raise ElasticJaxError(f"task '{task}' is not a family task ({', '.join(FAMILY_TASKS)})")
  filler = mx.FILLER_IDS if filler is None else filler
  fact, question = wording or FAMILY_TEMPLATES[task][template]
  fill = mx.fill_template
  if task == "cwe":
    if evidence != "far":
      raise ElasticJaxError("cwe has no evidence to move: its answer counts the whole list")
    marker = mx.encode(fact)
    q = mx.encode(question)
    slots = max(COMMON * 3 + 4, (length - len(marker) - len(q)) // 2)
    common = mx.distinct_ids(rng, mx.NAME_IDS, COMMON)
    rare_pool = np.setdiff1d(mx.NAME_IDS, common)
    per = max(3, slots // (4 * COMMON))          # each common name's count
    n_rare = slots - per * COMMON
    reps = -(-n_rare // len(rare_pool))           # rare names recur at most this often
    if reps >= per:
      raise ElasticJaxError(f"cwe: {length} tokens are too many for the names available")
    rare = np.resize(rng.permutation(rare_pool), n_rare)
    # The recurring names fill slots of the list's first 80% only (FACT_ZONE): the last
    # fifth, a streaming head's window, holds rare names alone.
    zone = int(mx.FACT_ZONE * slots)
    if per * COMMON > zone:
      raise ElasticJaxError(f"cwe: {length} tokens are too few for its list")
    at = np.sort(rng.choice(zone, size=per * COMMON, replace=False))
    rest = np.setdiff1d(np.arange(slots), at)
    items = np.empty(slots, rare.dtype)
    items[at] = np.repeat(common, per)[rng.permutation(per * COMMON)]
    items[rest] = rare[rng.permutation(n_rare)]
    first = sorted(common, key=lambda c: int(np.flatnonzero(items == c)[0]))
    comma = mx.IDS[","]
    body = np.stack([items, np.full_like(items, comma)], 1).reshape(-1)
    context = np.concatenate([marker, body])
    return mx.Sample(task, template, context, q, np.asarray(first, np.int32))
  if task == "vt":
    n_chain = int(rng.integers(3, 6))
    n_other = int(np.clip(length // 128, 1, 4))
    names = mx.distinct_ids(rng, mx.NAME_IDS, n_chain * (1 + n_other))
    values = mx.distinct_ids(rng, mx.NUMBER_IDS, 1 + n_other)
    chains = [names[i * n_chain:(i + 1) * n_chain] for i in range(1 + n_other)]
    pieces = [_chain_pieces(fact, c, v, fill) for c, v in zip(chains, values)]
    q = fill(question, v=values[0])
    answer = np.asarray(chains[0], np.int32)
    n_fill = max(8, length - sum(len(p) for ch in pieces for p in ch) - len(q))
    context = _place(rng, mx.filler_tokens(rng, n_fill, filler), pieces, evidence)
    # A guess among the chains (then read in order) is right one time in 1 + n_other.
    return mx.Sample(task, template, context, q, answer, candidates=1 + n_other)
  # mv and mq: kv facts, one key with several values (mv) or several asked keys (mq).
  n_facts = int(np.clip(length // 96, 3, 40))
  keys = mx.distinct_ids(rng, mx.NAME_IDS, n_facts)
  if task == "mv":
    n_vals = int(rng.integers(2, 5))
    vals = mx.distinct_ids(rng, mx.NUMBER_IDS, n_vals)
    others = mx.NUMBER_IDS[rng.integers(0, mx.NUM_NUMBERS, n_facts - 1)]
    own = [fill(fact, k=keys[0], v=v) for v in vals]            # read in this order
    rest = [[fill(fact, k=k, v=v)] for k, v in zip(keys[1:], others)]
    q = fill(question, k=keys[0])
    n_fill = max(8, length - sum(map(len, own)) - sum(len(p[0]) for p in rest) - len(q))
    context = _place(rng, mx.filler_tokens(rng, n_fill, filler), [own] + rest, evidence)
    return mx.Sample(task, template, context, q, np.asarray(vals, np.int32))
  n_asked = int(rng.integers(2, 4))
  vals = mx.NUMBER_IDS[rng.integers(0, mx.NUM_NUMBERS, n_facts)]
  pieces = [fill(fact, k=k, v=v) for k, v in zip(keys, vals)]
  asked = rng.choice(n_facts, size=n_asked, replace=False)
  text = _mq_question(question, asked)
  q = mx.encode(text.format(**{f"k{i}": mx.VOCAB[keys[j]] for i, j in enumerate(asked)}))
  n_fill = max(8, length - sum(map(len, pieces)) - len(q))
  groups = [[pieces[j] for j in asked]] + [[p] for j, p in enumerate(pieces) if j not in asked]
  if evidence == "far":
    context = mx.insert_pieces(rng, mx.filler_tokens(rng, n_fill, filler), pieces, mx.FACT_ZONE)
  else:
    context = _place(rng, mx.filler_tokens(rng, n_fill, filler), groups, evidence)
  return mx.Sample(task, template, context, q, np.asarray(vals[asked], np.int32))


def _place(rng, base, groups, evidence):
  """groups[0] holds the facts the answer needs: with evidence "near" they go, in order, to
  the end of the context and the other groups into its first 80%; else every group into
  the first 80% (_insert_groups)."""
  if evidence == "far":
    return _insert_groups(rng, base, groups, mx.FACT_ZONE)
  return np.concatenate([_insert_groups(rng, base, groups[1:], mx.FACT_ZONE)] + groups[0])


def _insert_groups(rng, base, groups, zone):
  """Pieces inserted at random sentence starts within the first `zone` of base, each group's
  pieces in the group's order (a chain reads forward, mv's values in the answer's order),
  the groups interleaved at random."""
  flat = [p for g in groups for p in g]
  starts = np.flatnonzero(base[:max(1, int(zone * len(base)))] == mx.DOT) + 1
  starts = np.concatenate([[0], starts])
  at = np.sort(rng.choice(starts, size=len(flat), replace=len(starts) < len(flat)))
  slot = rng.permutation(len(flat))
  pos = 0
  for g in groups:                    # a group's pieces take its slots in ascending order
    slot[pos:pos + len(g)] = np.sort(slot[pos:pos + len(g)])
    pos += len(g)
  out, prev = [], 0
  for i in np.argsort(slot):
    cut = at[slot[i]]
    out += [base[prev:cut], flat[i]]
    prev = cut
  out.append(base[prev:])
  return np.concatenate(out)


CWE_MARKERS = ("list :", "rows :", "series :", "sequence :", "line :")     # never "data :"


def pretraining_wording(task: str, rng: np.random.Generator, heldout: bool = False):
  """A wording of a family task for pretraining: half of the time a fixed one (kv's or hop's
  pretraining facts, FAMILY_PRETRAIN_QUESTIONS), else random template words; never the
  held-out template's unless `heldout`."""
  avoid = FAMILY_TEMPLATES[task][2]
  while True:
    if rng.random() < 0.5:
      wording = _random_wording(task, rng)
    elif task == "cwe":
      wording = (CWE_MARKERS[int(rng.integers(len(CWE_MARKERS)))],
                 FAMILY_PRETRAIN_QUESTIONS[task][int(rng.integers(5))])
    else:
      facts = mx.PRETRAIN_FACTS["hop" if task == "vt" else "kv"]
      questions = FAMILY_PRETRAIN_QUESTIONS[task]
      wording = (facts[int(rng.integers(len(facts)))],
                 questions[int(rng.integers(len(questions)))])
    if heldout or (wording[0] != avoid[0] and wording[1] != avoid[1]):
      return wording


def _random_wording(task: str, rng: np.random.Generator):
  w = lambda lo, hi: mx.random_words(rng, lo, hi)
  qend = ("?", ":", ".")[int(rng.integers(3))]
  if task == "cwe":
    return f"{w(1, 1)} :", f"{w(1, 4)} {qend}"
  fact, question = mx.random_wording("hop" if task == "vt" else "kv", rng)
  if task == "vt":
    return fact, f"{w(1, 4)} {{v}} {w(0, 2)} {qend}"
  if task == "mq":
    return fact, (w(1, 3), "{k}", ("and", ",", "then")[int(rng.integers(3))],
                  f"{w(0, 2)} {qend}".strip())
  return fact, question


def check_wordings() -> None:
  """Raises if a wording uses a word that is not a template word, or if pretraining could
  draw a family's held-out wording."""
  _check_words()
  for task in FAMILY_TASKS:
    fact, question = FAMILY_TEMPLATES[task][2]
    facts = CWE_MARKERS if task == "cwe" else mx.PRETRAIN_FACTS["hop" if task == "vt" else "kv"]
    if fact in facts or question in FAMILY_PRETRAIN_QUESTIONS[task]:
      raise ElasticJaxError(f"the held-out wording of {task} is among the pretraining ones")
