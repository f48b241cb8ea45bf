"""The router-training data pipeline: records, tokenization, truncation, packing, resumption.

Tokenizers are built here: a byte-level BPE trained on a few sentences (exact round trip), saved
with save_pretrained, once plain (it adds BOS itself) and once with a chat template.
"""

import json
import logging
import re
import time

import numpy as np
import pytest

from elastic_jax.errors import ElasticJaxError
from elastic_jax.tasks import AUTHORS_TASKS as AUTHOR_TASKS, TASK_TYPES, task_id
from elastic_jax.tokenizer import load_tokenizer
from elastic_jax.train.data import TrainData, read_records
from elastic_jax.train.synthetic import synthetic_batch
from toktools import CHAT_TEMPLATE, make_tokenizer

WORDS = ("the quick brown fox jumps over a lazy dog while paris is the capital of france and "
         "code returns values from functions when questions ask what who where").split()

@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
  """{"plain": dir, "chat": dir} of two tokenizers sharing one vocabulary."""
  texts = [" ".join(WORDS), "What is the capital of France? Paris.", "def f(x): return x + 1"]
  return {"plain": make_tokenizer(tmp_path_factory.mktemp("tok_plain"), texts),
          "chat": make_tokenizer(tmp_path_factory.mktemp("chat"), texts,
                                 chat_template=CHAT_TEMPLATE)}


@pytest.fixture(scope="module")
def tok(tok_dirs):
  return load_tokenizer(tok_dirs["plain"])


def write_jsonl(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def make_records(n, seed=0, max_words=40):
  rng = np.random.default_rng(seed)
  names = AUTHOR_TASKS + TASK_TYPES
  return [{"context": " ".join(rng.choice(WORDS, int(rng.integers(1, max_words)))),
           "question": f"question {i} what?", "answer": f"answer {i} " + str(rng.choice(WORDS)),
           "task": names[i % len(names)]} for i in range(n)]


def segments(batch, row):
  """(segment id, token slice) of each packed segment of one row."""
  seg = batch["segment_ids"][row]
  return [(s, np.flatnonzero(seg == s)) for s in np.unique(seg[seg > 0])]


# ---------------------------------------------------------------------------------------- records

GOOD = {"context": "Paris is the capital.", "question": "What is it?", "answer": "Paris",
        "task": "Single QA"}


@pytest.mark.parametrize("line, message", [
    ('{"context": "a", "question": "b", "answer": "c", "task": "Code"', "is not valid JSON"),
    ('["a", "b"]', "holds an array, not an object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "question"}), "has no 'question' field"),
    (json.dumps({**GOOD, "answer": 3}), "field 'answer' as a number, not a string"),
    (json.dumps({**GOOD, "context": None}), "field 'context' as null, not a string"),
    (json.dumps({**GOOD, "answer": "  "}), "has an empty answer"),
    (json.dumps({**GOOD, "task": "Poetry"}), "unknown task 'Poetry'"),
    (json.dumps({**GOOD, "context": "", "question": ""}), "empty context and an empty question"),
])
def test_bad_line_names_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, "", line, GOOD])
  with pytest.raises(ElasticJaxError, match=f"d.jsonl:4: the line .*{message}"):
    read_records(path)


def test_bad_utf8_and_empty_file(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"context": "\xff"}\n')
  with pytest.raises(ElasticJaxError, match="d.jsonl:2: the line is not valid UTF-8"):
    read_records(str(path))
  path.write_text("\n\n")
  with pytest.raises(ElasticJaxError, match="holds no records"):
    read_records(str(path))
  with pytest.raises(ElasticJaxError, match="no such data file"):
    read_records(str(tmp_path / "missing.jsonl"))


def test_task_names_map_to_task_ids(tmp_path):
  for i, (author, ours) in enumerate(zip(AUTHOR_TASKS, TASK_TYPES)):
    assert task_id(author) == task_id(ours) == task_id(author.upper()) == i
  assert task_id("In-Context Learning") == TASK_TYPES.index("icl")
  with pytest.raises(ElasticJaxError, match="task 'qa' is unknown"):
    task_id("qa")
  recs = read_records(write_jsonl(tmp_path / "d.jsonl",
                                  [{**GOOD, "task": t} for t in AUTHOR_TASKS + TASK_TYPES]))
  assert [r.task_id for r in recs] == list(range(5)) * 2
  assert [r.line for r in recs] == list(range(1, 11))


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(ElasticJaxError, match="no such tokenizer directory"):
    load_tokenizer(str(tmp_path / "nope"))
  with pytest.raises(ElasticJaxError, match="holds no tokenizer files"):
    load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ElasticJaxError, match="cannot load a tokenizer"):
    load_tokenizer(str(tmp_path))


# ------------------------------------------------------------------------------- tokens and rows

def test_batch_fields_match_synthetic_and_answer_only_loss(tmp_path, tok):
  recs = make_records(20)
  data = TrainData(write_jsonl(tmp_path / "d.jsonl", recs), tok, seq_len=96, batch_size=4,
                   max_segments=4, seed=1)
  ref = synthetic_batch(0, 4, 96, 100, max_segments=4)
  seen = 0
  for _ in range(3):
    batch = next(data)
    assert batch.keys() == ref.keys()
    for k, v in batch.items():
      assert v.dtype == ref[k].dtype and v.shape == ref[k].shape, k
    for row in range(4):
      pad = batch["segment_ids"][row] == 0
      assert not (batch["loss_mask"][row] | batch["prompt_mask"][row])[pad].any()
      assert (batch["positions"][row][pad] == 0).all()
      assert batch["task_ids"][row, 0] == -1
      used = [s for s, _ in segments(batch, row)]
      assert used == list(range(1, len(used) + 1))          # slots filled in order
      assert (batch["task_ids"][row, len(used) + 1:] == -1).all()
      for s, idx in segments(batch, row):
        assert (np.diff(idx) == 1).all()                     # contiguous
        ids, tgt = batch["input_ids"][row, idx], batch["targets"][row, idx]
        lm, pm = batch["loss_mask"][row, idx], batch["prompt_mask"][row, idx]
        np.testing.assert_array_equal(batch["positions"][row, idx], np.arange(len(idx)))
        np.testing.assert_array_equal(tgt[:-1], ids[1:])     # next token within the segment
        plen = int(pm.sum())
        assert pm[:plen].all() and not pm[plen:].any()      # prompt, then answer
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert not lm[-1] and lm[plen - 1:-1].all() and not lm[:plen - 1].any()
        rec = recs[int(re.search(r"question (\d+) what", tok.decode(ids[:plen])).group(1))]
        assert tok.decode(tgt[lm], skip_special_tokens=True) == rec["answer"]
        assert tgt[lm][-1] == tok.eos_token_id
        prompt = tok.decode(ids[:plen], skip_special_tokens=True)
        assert prompt == rec["context"] + "\n\n" + rec["question"] + "\n\n"
        assert batch["task_ids"][row, s] == task_id(rec["task"])
        seen += 1
  assert seen >= 12


def test_truncate_middle_and_skip(tmp_path, tok):
  long_ctx = " ".join(f"w{i}" for i in range(300))
  recs = [{"context": long_ctx, "question": "Which word?", "answer": "w7 then w299",
           "task": "MultiHop QA"}] + make_records(5, max_words=5)
  path = write_jsonl(tmp_path / "d.jsonl", recs)
  data = TrainData(path, tok, seq_len=128, batch_size=1, max_segments=2, num_epochs=1)
  assert data.stats["truncated"] == 1 and data.stats["skipped"] == 0
  assert data.stats["records_kept"] == 6
  for batch in data:
    ids, pm, lm = batch["input_ids"][0], batch["prompt_mask"][0], batch["loss_mask"][0]
    text = tok.decode(ids[pm], skip_special_tokens=True)
    if not text.startswith("w0"):
      continue
    assert (batch["segment_ids"][0] == 1).all()              # cut to exactly seq_len
    head, tail = text.split("\n\n")[0].split(" ")[:3], text.split("\n\n")[0].split(" ")[-3:]
    assert head == ["w0", "w1", "w2"] and tail == ["w297", "w298", "w299"]
    assert "w150" not in text.split()
    assert text.endswith("\n\nWhich word?\n\n")
    assert tok.decode(batch["targets"][0][lm], skip_special_tokens=True) == "w7 then w299"
    break
  else:
    pytest.fail("the truncated record never came")
  skipping = TrainData(path, tok, seq_len=128, batch_size=1, max_segments=2, overlong="skip")
  assert skipping.stats["skipped"] == 1 and skipping.stats["truncated"] == 0
  assert skipping.stats["records_kept"] == 5 and skipping.stats["records_read"] == 6
  with pytest.raises(ElasticJaxError, match="overlong policy 'cut' is unknown"):
    TrainData(path, tok, seq_len=128, batch_size=1, overlong="cut")


def test_record_too_long_even_without_context_is_skipped(tmp_path, tok):
  recs = [{**GOOD, "answer": " ".join(WORDS * 4)}] + make_records(3, max_words=3)
  data = TrainData(write_jsonl(tmp_path / "d.jsonl", recs), tok, seq_len=48, batch_size=1)
  assert data.stats["skipped"] == 1 and data.stats["records_kept"] == 3
  with pytest.raises(ElasticJaxError, match="none of its 1 records fits seq_len 48"):
    TrainData(write_jsonl(tmp_path / "e.jsonl", recs[:1]), tok, seq_len=48, batch_size=1)


def test_chat_template_used_when_present(tmp_path, tok_dirs, tok):
  pytest.importorskip("jinja2")                              # transformers renders with it
  path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
  chat = TrainData(path, tok_dirs["chat"], seq_len=64, batch_size=1, max_segments=2)
  assert chat.format.chat
  batch = next(chat)
  ids = batch["input_ids"][0]
  assert chat.tokenizer.decode(ids[batch["prompt_mask"][0]]) == (
      "<|user|>Paris is the capital.\n\nWhat is it?<|end|><|assistant|>")
  lm = batch["loss_mask"][0]
  assert chat.tokenizer.decode(batch["targets"][0][lm]) == "Paris</s>"
  plain = TrainData(path, tok_dirs["chat"], seq_len=64, batch_size=1, use_chat_template=False)
  assert not plain.format.chat
  assert tok.decode(next(plain)["input_ids"][0][:3]).startswith("<s>Paris")
  with pytest.raises(ElasticJaxError, match="has no chat template"):
    TrainData(path, tok_dirs["plain"], seq_len=64, batch_size=1, use_chat_template=True)


def test_packing_fills_rows_without_splitting(tmp_path, tok):
  path = write_jsonl(tmp_path / "d.jsonl", make_records(60, seed=3))
  data = TrainData(path, tok, seq_len=80, batch_size=4, max_segments=4, num_epochs=1)
  enc, lengths, plan = data.encoded, data.encoded.lengths, []
  ref = TrainData(path, tok, seq_len=80, batch_size=4, max_segments=4, num_epochs=1)
  for batch in data:
    rows = ref.next_rows()
    for row, recs in enumerate(rows):
      assert len(recs) <= 3 and lengths[recs].sum() <= 80
      segs = segments(batch, row)
      assert [s for s, _ in segs] == list(range(1, len(recs) + 1))
      for (s, idx), rec in zip(segs, recs):                  # each record whole, in order
        np.testing.assert_array_equal(batch["input_ids"][row, idx],
                                      enc.tokens[enc.starts[rec]:enc.starts[rec + 1]])
    plan += [r for r in rows if r]
  for row, after in zip(plan, plan[1:]):                     # next fit: a row closes when full
    assert len(row) == 3 or lengths[row].sum() + lengths[after[0]] > 80
  seen = [rec for row in plan for rec in row]
  assert sorted(seen) == list(range(60))                     # one epoch: every record once
  assert data.stats["epoch"] == 1


# ---------------------------------------------------------------------------- order and restarts

def test_resume_gives_the_same_batches_across_epochs(tmp_path, tok):
  path = write_jsonl(tmp_path / "d.jsonl", make_records(14, seed=5, max_words=20))
  kw = dict(seq_len=64, batch_size=4, max_segments=3, seed=7)
  full = TrainData(path, tok, **kw)
  run = [next(full) for _ in range(12)]
  assert full.stats["epoch"] >= 2                            # the run crosses epoch boundaries
  epochs = []
  for k in (0, 3, 5, 9):
    part = TrainData(path, tok, **kw)
    for _ in range(k):
      next(part)
    state = json.loads(json.dumps(part.state()))
    epochs.append(state["epoch"])
    resumed = TrainData(path, tok, **kw).restore(state)
    assert resumed.stats["batches"] == k
    for want in run[k:]:
      got = next(resumed)
      for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"k={k} {name}")
  assert len(set(epochs)) > 1
  other = TrainData(path, tok, **{**kw, "seed": 8})
  with pytest.raises(ElasticJaxError, match="saved for other data or settings"):
    other.restore(state)
  with pytest.raises(ElasticJaxError, match="not one that TrainData.state"):
    other.restore({"epoch": 0})


def test_epochs_are_shuffled_by_seed(tmp_path, tok):
  path = write_jsonl(tmp_path / "d.jsonl", make_records(40, seed=2, max_words=3))
  def order(seed):
    data = TrainData(path, tok, seq_len=32, batch_size=1, max_segments=2, seed=seed)
    return [data.next_rows()[0][0] for _ in range(80)]
  a = order(0)
  assert sorted(a[:40]) == sorted(a[40:]) == list(range(40)) and a[:40] != a[40:]
  assert a == order(0) and a != order(1)


@pytest.mark.parametrize("count", [2, 4])
def test_processes_split_the_global_batch(tmp_path, tok, count):
  path = write_jsonl(tmp_path / "d.jsonl", make_records(50, seed=4))
  kw = dict(seq_len=64, batch_size=8, max_segments=3, seed=3)
  whole = TrainData(path, tok, **kw)
  parts = [TrainData(path, tok, process_index=p, process_count=count, **kw)
           for p in range(count)]
  for step in range(6):
    if step == 3:                                            # a 1-process state restores on all
      parts = [TrainData(path, tok, process_index=p, process_count=count, **kw)
               .restore(whole.state()) for p in range(count)]
    want = next(whole)
    got = [next(p) for p in parts]
    for name in want:
      assert all(g[name].shape[0] == 8 // count for g in got)
      np.testing.assert_array_equal(np.concatenate([g[name] for g in got]), want[name])
  with pytest.raises(ElasticJaxError, match="does not divide over 3 processes"):
    TrainData(path, tok, process_index=0, process_count=3, **kw)


def test_thousands_of_records_are_quick_and_logged(tmp_path, tok, caplog):
  path = write_jsonl(tmp_path / "d.jsonl", make_records(4000, seed=6, max_words=200))
  start = time.perf_counter()
  with caplog.at_level(logging.INFO, logger="elastic_jax.train.data"):
    data = TrainData(path, tok, seq_len=512, batch_size=8, max_segments=8)
    batches = [next(data) for _ in range(20)]
  assert time.perf_counter() - start < 10.0
  assert "4000 records read, 4000 kept" in caplog.text
  assert data.stats["records_read"] == 4000 and data.stats["tokens"] > 4000 * 20
  fill = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
  assert fill > 0.7


def test_batches_feed_router_pooling_and_objective(tmp_path, tok):
  """Packed rows pool each segment's prompt on its own; the objective sees every segment."""
  import jax
  import jax.numpy as jnp
  from elastic_jax.router import RouterConfig, pool_prompt
  from elastic_jax.train.objective import (ObjectiveConfig, answer_cross_entropy,
                                           init_lambdas, sparsity_penalty)
  data = TrainData(write_jsonl(tmp_path / "d.jsonl", make_records(12, max_words=6)), tok,
                   seq_len=64, batch_size=2, max_segments=4)
  batch = next(data)
  assert (batch["segment_ids"].max(1) >= 2).any()            # really packed
  keys = np.random.default_rng(0).normal(size=(2, 64, 2, 8)).astype(np.float32)
  rcfg = RouterConfig(pooling="prompt_mean")
  pooled = np.asarray(pool_prompt(jnp.asarray(keys), batch["segment_ids"], batch["positions"],
                                  batch["prompt_mask"], rcfg, 4))
  for row in range(2):
    for s, idx in segments(batch, row):
      want = keys[row, idx[batch["prompt_mask"][row, idx]]].mean(0)
      np.testing.assert_allclose(pooled[row, s], want, rtol=1e-5, atol=1e-6)
  logits = jnp.zeros((2, 64, len(tok)))
  lm = answer_cross_entropy(logits, batch["targets"], batch["loss_mask"])
  np.testing.assert_allclose(float(lm), np.log(len(tok)), rtol=1e-5)
  _, _, count = sparsity_penalty(jnp.full((2, 4), 0.5), batch["task_ids"],
                                 init_lambdas(jax.random.key(0)), ObjectiveConfig())
  assert int(np.asarray(count).sum()) == int((batch["task_ids"] >= 0).sum()) >= 3
