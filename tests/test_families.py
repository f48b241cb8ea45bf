"""RULER's families on the mixture (eval/families.py): each sample solved from its text alone
by parsers written here from the wordings, not from the generator, and not from a streaming
head's window (the last 64 tokens); the vocabulary and the five tasks' pretraining batches as
they were (the shipped backbone depends on both); the families' pretraining rows."""

import collections
import hashlib
import re

import numpy as np
import pytest

from elastic_jax.eval import families, mixture
from elastic_jax.repro import pretrain

WINDOW = 64
KV = [r"the value of key {k} is (\d+) \.", r"key {k} has value (\d+) \.",
      r"remember that {k} maps to (\d+) \."]
CHAIN = [r"set (n\d+) = {x} ;", r"(n\d+) is equal to {x} \.", r"(n\d+) links to {x} \."]


def _values(text, key):
  return [m for p in KV for m in re.findall(p.format(k=key), text)]


def _mv(text, question):
  key = re.search(r"\b(n\d+)\b", question).group(1)
  # Every value of the key, in the order they stand in the text.
  hits = sorted((m.start(), m.group(1)) for p in KV
                for m in re.finditer(p.format(k=key), text))
  return " ".join(v for _, v in hits) or None


def _mq(text, question):
  out = []
  for key in re.findall(r"\b(n\d+)\b", question):
    vals = _values(text, key)
    if len(vals) != 1:
      return None
    out.append(vals[0])
  return " ".join(out)


def _vt(text, question):
  value = re.search(r"\b(\d+)\b", question).group(1)
  chain, x = [], value
  while True:
    nxt = [m for p in CHAIN for m in re.findall(p.format(x=x), text)]
    if len(nxt) != 1:
      break
    chain.append(nxt[0])
    x = nxt[0]
  return " ".join(chain) if len(chain) >= 3 else None


def _cwe(text, question):
  for marker in ("list :", "rows :", "data :"):
    if text.startswith(marker):
      names = text[len(marker):].split()[::2]
      counts = collections.Counter(names)
      top = counts.most_common(4)
      if len(top) < 4 or top[2][1] <= top[3][1]:
        return None
      common = {n for n, _ in top[:3]}
      return " ".join(sorted(common, key=names.index))
  return None


SOLVERS = {"mv": _mv, "mq": _mq, "vt": _vt, "cwe": _cwe}


@pytest.mark.parametrize("task", families.FAMILY_TASKS)
def test_families_are_solvable_from_the_whole_prompt_only(task):
  for template in (0, 1, 2):
    rng = np.random.default_rng([5, template])
    for length in (384, 896, 1536):
      s = mixture.make_sample(task, rng, length, template)
      text, question = mixture.decode(s.context), mixture.decode(s.question)
      answer = mixture.decode(s.answer)
      assert abs(s.prompt_len - length) <= 40 and 2 <= len(s.answer) <= 5
      assert SOLVERS[task](text, question) == answer, (task, template, length)
      tail = mixture.decode(s.context[-(WINDOW - len(s.question)):])
      assert SOLVERS[task](tail, question) != answer
  assert mixture.is_sensitive(task) and mixture.TASK_TYPE[task] in ("Single QA", "MultiHop QA")


def test_wordings_keep_the_vocabulary_and_hold_out_the_third():
  mixture.check_wordings()
  assert len(mixture.VOCAB) == 861                      # the shipped tokenizer's
  rng = np.random.default_rng(0)
  for task in families.FAMILY_TASKS:
    held = families.FAMILY_TEMPLATES[task][2]
    for _ in range(300):
      fact, question = mixture.pretraining_wording(task, rng)
      assert fact != held[0] and question != held[1]
      s = mixture.make_sample(task, rng, 512, -1, wording=(fact, question),
                              filler=mixture.PRETRAIN_FILLER)
      assert len(s.answer) >= 2 and (s.context < len(mixture.VOCAB)).all()


def test_five_task_pretraining_batches_are_unchanged():
  # The shipped backbone's data: step 3001's batch, as it was when the backbone was made.
  b = pretrain.make_batch((0, 8192, 2048, 0.2, False, mixture.TASKS), 3001)
  digest = hashlib.sha256(b["ids"].tobytes() + b["targets"].tobytes()
                          + b["kind"].tobytes()).hexdigest()[:16]
  assert digest == DIGEST_3001
  assert [pretrain.TASKS[i] for i in b["task"]] == TASKS_3001


def test_family_pretraining_rows():
  b = pretrain.make_batch((1, 16384, 1024, 0.0, False, families.FAMILY_TASKS), 9)
  names = {pretrain.TASKS[i] for i in b["task"]}
  assert names <= set(families.FAMILY_TASKS) and len(names) >= 3
  answers = (b["kind"] == pretrain.ANSWER).sum(1)
  assert (answers >= 2).all()                           # every row asks for a list
  eos = (b["kind"] == pretrain.ANSWER_EOS).sum(1)
  assert (eos >= 1).all()


# Computed with the code that made the shipped backbone (before the families), 2026-12-07.
DIGEST_3001 = "bac23ac71924a867"
TASKS_3001 = ["hop", "kv", "hop", "hop", "summary", "summary", "pattern", "kv"]


@pytest.mark.parametrize("task", ["mv", "mq", "vt"])
def test_near_evidence_lies_inside_the_window(task):
  """The reviewer's check: with evidence 'near' the answer's facts are in the last 64
  tokens, where a streaming head sees them; cwe refuses (its answer counts the list)."""
  rng = np.random.default_rng(8)
  for template in (0, 2):
    s = mixture.make_sample(task, rng, 896, template, evidence="near")
    tail = mixture.decode(s.context[-(WINDOW - len(s.question)):])
    assert SOLVERS[task](tail, mixture.decode(s.question)) == mixture.decode(s.answer)
  with pytest.raises(Exception, match="cwe has no evidence to move"):
    mixture.make_sample("cwe", rng, 384, 0, evidence="near")


def test_items_in_pretraining_wordings_keep_the_held_out_one_unseen():
  items = list(mixture.eval_samples(2, 6, ("kv", "mq"), (384,), (384,),
                                    wordings="pretraining"))
  seen = [s for _, v, s in items if v == "seen"]
  held = [s for _, v, s in items if v == "held-out"]
  assert {s.template for s in seen} == {-1} and {s.template for s in held} == {2}
  held_out_question = re.compile(r"^tell me what n\d+( and n\d+)* maps to \.$")
  assert all(held_out_question.match(mixture.decode(s.question)) for s in held)
  assert not any(held_out_question.match(mixture.decode(s.question)) for s in seen)
  assert len({mixture.decode(s.question).split()[0] for s in seen}) > 3   # many wordings
