"""The reproduction's task mixture, its tokenizer, the pretraining batches and the static router.

The task checks solve each sample from its text alone, with small parsers written here from
the templates' wording (not the generator's code): a sensitive task must be solvable from the
whole prompt and not from its last 64 tokens (its facts lie far back); a robust one from its
last 64 tokens alone (a streaming head's local window at the reproduction's scale).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.eval import mixture
from elastic_jax.repro.pretrain import make_rows, row_lengths

WINDOW = 64


def _kv(text, question):
  key = re.search(r"\b(n\d+)\b", question).group(1)
  pats = [rf"the value of key {key} is (\d+) \.", rf"key {key} has value (\d+) \.",
          rf"remember that {key} maps to (\d+) \."]
  found = [m for p in pats for m in re.findall(p, text)]
  return found[0] if len(found) == 1 else None


def _hop(text, question):
  a = re.search(r"\b(n\d+)\b", question).group(1)
  pats = [r"{} is equal to (\S+) \.", r"set {} = (\S+) ;", r"{} links to (\S+) \."]

  def follow(x):
    found = [m for p in pats for m in re.findall(p.format(x), text)]
    return found[0] if len(found) == 1 else None
  b = follow(a)
  v = follow(b) if b else None
  return f"{b} {v}" if b and v else None


def _summary(text, question):
  for marker in ("passage :", "notes :", "text :"):
    if marker in text:
      words = text.rsplit(marker, 1)[1].split()
      return " ".join(words[:3]) if len(words) >= 4 else None
  return None


def _pattern(text, question):
  for marker in ("code :", "def f :", "loop :"):
    if marker in text:
      line = text.rsplit(marker, 1)[1].split()
      for p in range(1, len(line)):
        if all(line[i] == line[i - p] for i in range(p, len(line))):
          return " ".join(line[len(line) - p + (j % p)] for j in range(3))
  return None


def _fewshot(text, question):
  key, sep = question.split()[0], " ".join(question.split()[1:])
  found = re.findall(rf"\b{key} {re.escape(sep)} (\d+)", text)
  return found[-1] if found else None


SOLVERS = {"kv": _kv, "hop": _hop, "summary": _summary, "pattern": _pattern,
           "fewshot": _fewshot}


@pytest.mark.parametrize("task", mixture.TASKS)
@pytest.mark.parametrize("template", [0, 1, 2])
def test_tasks_are_solvable_from_the_right_span(task, template):
  rng = np.random.default_rng([3, template])
  for length in (300, 900):
    s = mixture.make_sample(task, rng, length, template)
    text, question = mixture.decode(s.context), mixture.decode(s.question)
    answer = mixture.decode(s.answer)
    assert abs(s.prompt_len - length) <= 40
    solve = SOLVERS[task]
    assert solve(text, question) == answer
    tail = mixture.decode(s.context[-(WINDOW - len(s.question)):])
    if task in mixture.SENSITIVE:
      assert solve(tail, question) != answer
    else:
      assert solve(tail, question) == answer


def test_variants_are_deterministic_and_held_out_uses_its_own_template():
  held = mixture.Variant("held-out", (2,), 200, 400)
  a = [s.record() for s in mixture.samples(held, 3, seed=1)]
  b = [s.record() for s in mixture.samples(held, 3, seed=1)]
  c = [s.record() for s in mixture.samples(held, 3, seed=2)]
  assert a == b and a != c
  assert {r["template"] for r in a} == {2}
  assert [r["name"] for r in a[:5]] == list(mixture.TASKS)
  train = mixture.Variant("train", (0, 1), 200, 400)
  assert {s.template for s in mixture.samples(train, 6, seed=1)} <= {0, 1}
  with pytest.raises(Exception, match="lengths"):
    mixture.Variant("bad", (0,), 8, 4)


def test_tokenizer_matches_the_generator(tmp_path):
  from transformers import AutoTokenizer
  mixture.build_tokenizer(str(tmp_path))
  tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (mixture.BOS, mixture.EOS,
                                                                   mixture.PAD)
  rng = np.random.default_rng(0)
  for task in mixture.TASKS:
    s = mixture.make_sample(task, rng, 200, 2)
    r = s.record()
    ids = tok(r["context"] + " " + r["question"])["input_ids"]
    assert ids == [mixture.BOS, *s.context.tolist(), *s.question.tolist()]
    assert tok.decode(s.answer.tolist()) == r["answer"]
  with pytest.raises(Exception, match="vocabulary"):
    mixture.encode("the value of zebra-crossing")


def test_pretraining_rows_hold_one_sample_each():
  b = make_rows(np.random.default_rng(0), 6, 256)
  ids, tgt, valid, answer = b["ids"], b["targets"], b["valid"], b["answer"]
  real = b["segment_ids"] > 0
  for r in range(6):
    n = int(real[r].sum())
    assert real[r, :n].all() and not real[r, n:].any() and 128 <= n <= 256
    assert ids[r, 0] == mixture.BOS and ids[r, n - 1] == mixture.EOS and (ids[r, n:] == 0).all()
    assert valid[r, :n - 1].all() and not valid[r, n - 1:].any()
  # Targets are next tokens; answer marks sit on answer tokens or EOS, inside the sample.
  assert (tgt[:, :-1] == ids[:, 1:]).all()
  assert not (answer & ~valid).any()
  answers = tgt[answer]
  assert (answers == mixture.EOS).sum() >= 6 and answer.sum() < 0.2 * valid.sum()
  assert np.isin(answers, np.concatenate([mixture.NAME_IDS, mixture.NUMBER_IDS,
                                          mixture.FILLER_IDS, [mixture.EOS]])).all()
  lengths, probs = row_lengths(1024)
  assert lengths.tolist() == list(range(128, 1025, 128)) and np.isclose(probs.sum(), 1.0)
  assert (np.diff(probs) < 0).all()


def test_static_router_is_input_independent_and_trains():
  from elastic_jax import router as rt
  from elastic_jax.config import ModelConfig
  cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                    rope_theta=1e4, qk_norm=True)
  rcfg = rt.RouterConfig(static=True)
  p = rt.init_router_params(cfg, rcfg, jax.random.key(0))
  assert set(p) == {"static_logits"} and p["static_logits"].shape == (2, 2, 2)
  p = {"static_logits": p["static_logits"].at[0, 1, 1].set(3.0)}
  layer0 = {"static_logits": p["static_logits"][0]}
  a = rt.router_logits(layer0, jax.random.normal(jax.random.key(1), (3, 2, 2, 8)))
  b = rt.router_logits(layer0, jnp.zeros((3, 2, 2, 8)))
  np.testing.assert_array_equal(a, b)
  gate, _ = rt.gate_from_logits(a, rcfg)
  np.testing.assert_array_equal(gate, np.broadcast_to([0.0, 1.0], (3, 2, 2)))

  def loss(q):
    g, _ = rt.gate_from_logits(rt.router_logits({"static_logits": q}, jnp.zeros((1, 1, 2, 8))),
                               rcfg, key=jax.random.key(2), tau=1.0)
    return g.sum()
  grad = jax.grad(loss)(p["static_logits"][0])
  assert np.abs(np.asarray(grad)).sum() > 0
