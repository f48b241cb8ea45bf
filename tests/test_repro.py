"""The reproduction's task mixture, its tokenizer, the pretraining batches and the static router.

The task checks solve each sample from its text alone, with small parsers written here from
the templates' wording (not the generator's code): a sensitive task must be solvable from the
whole prompt and not from its last 64 tokens (its facts lie far back); a robust one from its
last 64 tokens alone (a streaming head's local window at the reproduction's scale).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.eval import mixture
from elastic_jax.repro import pretrain

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


@pytest.mark.parametrize("task", mixture.SENSITIVE)
def test_near_evidence_is_solvable_from_the_window(task):
  # A reviewer's variant: the needed facts at the context's end, the others far back.
  rng = np.random.default_rng(9)
  for template in (0, 1, 2):
    s = mixture.make_sample(task, rng, 896, template, evidence="near")
    tail = mixture.decode(s.context[-(WINDOW - len(s.question)):])
    assert SOLVERS[task](tail, mixture.decode(s.question)) == mixture.decode(s.answer)
    assert SOLVERS[task](mixture.decode(s.context), mixture.decode(s.question)) == \
        mixture.decode(s.answer)


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
  b = pretrain.make_batch((0, 2048, 512, 0.2, False, mixture.TASKS), 3)
  ids, tgt, kind, seg = b["ids"], b["targets"], b["kind"], b["segment_ids"]
  rows, t = ids.shape
  assert rows == 2048 // t and t in (128, 256, 512)
  for r in range(rows):
    n = int((seg[r] > 0).sum())
    assert (seg[r, :n] > 0).all() and not seg[r, n:].any() and t // 2 <= n <= t
    assert ids[r, 0] == mixture.BOS and (ids[r, n:] == 0).all()
    # The kind of each target: context, then answers each closed by an EOS; nothing on padding.
    assert (kind[r, n - 1:] == 0).all() and (kind[r, :n - 1] > 0).all()
  assert (tgt[:, :-1] == ids[:, 1:]).all()
  answers, eos = tgt[kind == pretrain.ANSWER], tgt[kind == pretrain.ANSWER_EOS]
  assert (eos == mixture.EOS).all() and len(eos) >= rows
  assert np.isin(answers, np.concatenate([mixture.NAME_IDS, mixture.NUMBER_IDS,
                                          mixture.FILLER_IDS])).all()
  # The same step gives the same batch (resumed pieces see what an unbroken run sees).
  again = pretrain.make_batch((0, 2048, 512, 0.2, False, mixture.TASKS), 3)
  assert all((again[k] == b[k]).all() for k in b)


def test_sensitive_pretraining_rows_ask_about_every_fact_that_fits():
  rng = np.random.default_rng(5)
  for _ in range(20):
    task, s = pretrain.pretraining_sample(rng, 1024, 0.0)
    if mixture.TASKS[task] != "kv":
      continue
    asked = 1 + len(s.extra)
    assert asked == s.candidates            # every key is asked
    tokens, kind = pretrain.sample_tokens(s, 10 ** 6)
    assert (kind == pretrain.ANSWER_EOS).sum() == asked and tokens[-1] == mixture.EOS
    # In a row of 1024 tokens: the questions that fit, whole, and none cut off.
    tokens, kind = pretrain.sample_tokens(s, 1024)
    fitted = int((kind == pretrain.ANSWER_EOS).sum())
    assert 1 <= fitted <= asked and len(tokens) <= 1024 and tokens[-1] == mixture.EOS


def test_pretraining_wordings_never_use_the_held_out_template():
  rng = np.random.default_rng(0)
  for task in mixture.TASKS:
    held = mixture.TEMPLATES[task][mixture.HELDOUT_TEMPLATE]
    seen = {mixture.pretraining_wording(task, rng) for _ in range(3000)}
    assert len(seen) > 100                  # random wordings: no wording is special
    norm = {(" ".join(f.split()), " ".join(q.split())) for f, q in seen}
    assert not any(f == held[0] or q == held[1] for f, q in norm), task
    with_held = {mixture.pretraining_wording(task, rng, heldout=True) for _ in range(3000)}
    assert held in with_held or task == "fewshot" and any(f == held[0] for f, _ in with_held)
  # The copy task: a string of distinct names and numbers, asked by its first two tokens.
  c = mixture.copy_sample(rng, 300)
  string = np.concatenate([c.question, c.answer])
  assert 10 <= len(string) <= 20 and len(set(string.tolist())) == len(string)
  ctx = c.context.tolist()
  at = next(i for i in range(len(ctx)) if ctx[i:i + len(string)] == string.tolist())
  assert at <= 0.8 * len(ctx)


def test_pretraining_learning_rate_warms_holds_and_decays():
  args = pretrain.parse_args(["--out", "x", "--total-steps", "1000", "--warmup", "100"])
  lr = [pretrain.learning_rate_at(s, args) for s in range(1000)]
  assert lr[0] == pytest.approx(2e-3 / 100) and lr[99] == pytest.approx(2e-3)
  assert lr[100:800] == [2e-3] * 700
  assert (np.diff(lr[800:]) < 0).all() and lr[-1] == pytest.approx(2e-4, rel=0.05)


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


def test_pretraining_resumes_in_pieces_and_refuses_what_would_mix_runs(tmp_path):
  from safetensors.numpy import load_file
  from elastic_jax.errors import ElasticJaxError
  config = tmp_path / "config.json"
  config.write_text(json.dumps({
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024,
      "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
      "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
      "max_position_embeddings": 1024, "tie_word_embeddings": True, "bos_token_id": 1,
      "eos_token_id": 2, "pad_token_id": 0}))
  common = ["--config", str(config), "--total-steps", "3", "--tokens", "512", "--seq-len",
            "256", "--short-seq-len", "128", "--long-from", "2", "--warmup", "2",
            "--compute-dtype", "float32", "--attn-impl", "reference", "--eval-every", "3",
            "--eval-samples", "1", "--eval-lengths", "128,160", "--sparse-window", "16,1,2",
            "--log-every", "1", "--workers", "0"]
  assert pretrain.main(["--out", str(tmp_path / "whole"), *common]) == 0
  # Pieces of one step each (a budget of 0 s): three runs, two of them resumed.
  assert pretrain.main(["--out", str(tmp_path / "parts"), *common, "--piece-seconds", "0"]) == 0
  assert not (tmp_path / "parts" / "hf").exists()
  with pytest.raises(ElasticJaxError, match="--resume"):
    pretrain.main(["--out", str(tmp_path / "parts"), *common])
  with pytest.raises(ElasticJaxError, match="other data"):
    pretrain.main(["--out", str(tmp_path / "parts"), *common, "--resume", "--seed", "1"])
  for _ in range(2):
    assert pretrain.main(["--out", str(tmp_path / "parts"), *common, "--resume",
                          "--piece-seconds", "0"]) == 0
  info = json.load(open(tmp_path / "parts" / "hf" / "pretrain.json"))
  assert [(p["start_step"], p["end_step"]) for p in info["pieces"]] == [(0, 1), (1, 2), (2, 3)]
  whole = load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))
  parts = load_file(str(tmp_path / "parts" / "hf" / "model.safetensors"))
  steps = [json.loads(x)["step"] for x in open(tmp_path / "parts" / "metrics.jsonl")
           if "loss" in json.loads(x)]
  assert steps == [1, 2, 3]
  # The same batches and the same updates, up to the moments' bfloat16 rounding between pieces.
  for k in whole:
    a, b = whole[k].astype(np.float32), parts[k].astype(np.float32)
    assert np.abs(a - b).max() <= 0.02 * np.abs(a).max() + 1e-3, k
