"""The authors' parquet training data (their SFT records and their packer's rows) through
TrainData and train.py, and train.py's full-model export in the authors' layout."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import elastic_jax as ej
from elastic_jax.errors import ElasticJaxError
from elastic_jax.train.authors_data import AUTHORS_TASKS
from elastic_jax.train.data import TrainData
from elastic_jax.router_io import load_routers
from toktools import CHAT_TEMPLATE, make_tokenizer, save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the river keeps a secret number seven under the old bridge while the baker counts "
         "loaves and the code prints hello world twice").split()


def _text(rng, n):
  return " ".join(rng.choice(WORDS, n))


def _sft_records(n=10, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    task = AUTHORS_TASKS[i % 5]
    meta = {"task": task, "is_prefix": bool(i % 2), "length": 100}
    out.append({"context": "CTXSTART " + _text(rng, 30), "question": "QSTART " + _text(rng, 5),
                "answer": "ANS " + _text(rng, 3), "metadata": meta})
  return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  texts = [" ".join(WORDS), "CTXSTART QSTART ANS Summary: Please complete the code given "
           "below. You are given several news passages. Write a one-page summary of all news."]
  return make_tokenizer(root, texts, chat_template=CHAT_TEMPLATE)


def _write_sft(path, records, meta_as=dict):
  """Their SFT layout; metadata as a struct column, or as strings (repr: their Python
  literal; json.dumps)."""
  meta = [r["metadata"] if meta_as is dict else meta_as(r["metadata"]) for r in records]
  table = pa.table({"context": [r["context"] for r in records],
                    "question": [r["question"] for r in records],
                    "answer": [r["answer"] for r in records], "metadata": meta})
  pq.write_table(table, path)


def test_sft_records_render_as_the_authors_packer(tok_dir, tmp_path):
  """Question before context when is_prefix, their instructions for Summarization and Code,
  the chat template's user turn as the prompt, loss on the assistant turn only."""
  records = _sft_records(15)
  path = tmp_path / "sft"          # a directory of parquet files, as their packer reads
  path.mkdir()
  for k, meta_as in enumerate((dict, repr, json.dumps)):
    _write_sft(path / f"part{k}.parquet", records[5 * k:5 * k + 5], meta_as)
  data = TrainData(str(path), tok_dir, seq_len=512, batch_size=2, max_segments=3)
  enc, tok = data.encoded, data.tokenizer
  assert len(enc) == len(records)
  assert enc.task_ids.tolist() == [i % 5 for i in range(len(records))]
  for i, r in enumerate(records):
    ids = enc.tokens[enc.starts[i]:enc.starts[i + 1]]
    p = int(enc.prompt_len[i])
    prompt, rest = tok.decode(ids[:p]), tok.decode(ids[p:])
    assert prompt.startswith("<|user|>") and prompt.endswith("<|end|>")
    q_first = prompt.index("QSTART") < prompt.index("CTXSTART")
    assert q_first == (i % 2 == 1)             # is_prefix
    task = AUTHORS_TASKS[i % 5]
    assert prompt.startswith("<|user|>You are given several news passages.") == (
        task == "Summarization")
    assert ("Summary:" in prompt) == (task == "Summarization")
    assert prompt.startswith("<|user|>Please complete the code given below.") == (task == "Code")
    assert rest.startswith("<|assistant|>ANS") and ids[-1] == tok.eos_token_id
    target = enc.targets[enc.starts[i]:enc.starts[i + 1]]
    assert not target[:p].any() and target[p:].all()
  batch = next(data)
  # The loss mask marks the positions predicting assistant tokens, nothing else.
  for row in range(2):
    for t in np.flatnonzero(batch["loss_mask"][row]):
      seg = batch["segment_ids"][row, t]
      assert batch["segment_ids"][row, t + 1] == seg and not batch["prompt_mask"][row, t + 1]


def test_packed_rows_become_records_again(tok_dir, tmp_path):
  """Their packer's cache: seq_lengths split rows into samples, range_ids mark the prompt,
  labels the loss; our packer re-packs the samples."""
  rng = np.random.default_rng(1)
  rows, expect = [], []
  for r in range(3):
    ids, labels, bounds, tasks, ranges = [], [], [0], [], []
    for s in range(2 + r):
      n, user = int(rng.integers(40, 90)), int(rng.integers(10, 30))
      sample = rng.integers(5, 300, n).tolist()
      lab = [-100] * user + sample[user:]
      ids += sample
      labels += lab
      bounds.append(len(ids))
      tasks.append(int((r + s) % 5))
      ranges.append([0, 0, 0, user - 1, 0, user - 1, user, n - 1])
      expect.append((sample, user, tasks[-1]))
    rows.append({"input_ids": ids, "labels": labels, "seq_lengths": bounds,
                 "task_ids": tasks, "task_type": [AUTHORS_TASKS[t] for t in tasks],
                 "range_ids": ranges})
  path = tmp_path / "packed.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  data = TrainData(str(path), tok_dir, seq_len=256, batch_size=1, max_segments=4)
  enc = data.encoded
  assert len(enc) == len(expect)
  for i, (sample, user, task) in enumerate(expect):
    np.testing.assert_array_equal(enc.tokens[enc.starts[i]:enc.starts[i + 1]], sample)
    assert enc.prompt_len[i] == user and enc.task_ids[i] == task
  b = next(data)
  for seg in range(1, 4):
    where = np.flatnonzero(b["segment_ids"][0] == seg)
    if not where.size:
      continue
    user = int(b["prompt_mask"][0, where].sum())
    # Trained positions: those predicting tokens user .. end of the sample.
    np.testing.assert_array_equal(np.flatnonzero(b["loss_mask"][0, where]),
                                  np.arange(user - 1, where.size - 1))
  # A sample tagged with their "Other" class (5) is refused by name.
  rows[0]["task_ids"][0] = 5
  pq.write_table(pa.Table.from_pylist(rows), path)
  with pytest.raises(ElasticJaxError, match=r"row 0 sample 0: task id 5 is none of the five"):
    TrainData(str(path), tok_dir, seq_len=256, batch_size=1, max_segments=4)


def test_bad_parquet_is_refused(tok_dir, tmp_path):
  path = tmp_path / "other.parquet"
  pq.write_table(pa.table({"text": ["a"]}), path)
  with pytest.raises(ElasticJaxError, match="neither the authors' SFT records"):
    TrainData(str(path), tok_dir, seq_len=256, batch_size=1)
  records = _sft_records(2)
  records[1]["metadata"] = {"task": "Translation"}
  _write_sft(path, records)
  with pytest.raises(ElasticJaxError, match="record 1: task 'Translation' is none of the five"):
    TrainData(str(path), tok_dir, seq_len=256, batch_size=1)
  (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(ElasticJaxError, match="not a readable parquet file"):
    TrainData(str(tmp_path / "broken.parquet"), tok_dir, seq_len=256, batch_size=1)


def test_train_py_on_their_data_exports_the_full_model(tok_dir, tmp_path):
  """train.py reads their SFT parquet, trains, and writes the backbone with the trained
  routers in their full-model layout, which loads back with those routers."""
  model_dir = tmp_path / "model"
  save_tiny_model(model_dir, [" ".join(WORDS)], max_position_embeddings=2048,
                  chat_template=CHAT_TEMPLATE)
  _write_sft(tmp_path / "train.parquet", _sft_records(12))
  run = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
       f"model.path={model_dir}", "model.dtype=float32", f"data.train_path={tmp_path}/"
       "train.parquet", "data.seq_len=512", "data.global_batch=2", "data.max_segments=4",
       "router.block=128", "router.boundary=100", "router.local_blocks=1", "train.steps=2",
       "log.every_steps=1", "checkpoint.every_steps=0", "export.full_model=true",
       f"run_dir={run}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "12 records read, 12 kept" in proc.stderr + proc.stdout or "step     2/2" in proc.stdout
  full = run / "export" / "full_model"
  assert f"routers exported (full_model): {full}" in proc.stdout
  config = json.loads((full / "config.json").read_text())
  assert config["architectures"] == ["PawQwen3ForCausalLM"]
  assert (config["sink_size"], config["local_window_size"]) == (128, 128)
  loaded = ej.from_pretrained(full, dtype="float32", show_progress=False)
  trained = load_routers(str(run / "export" / "elastic_jax"))
  for key, value in trained.params.items():
    np.testing.assert_array_equal(np.asarray(loaded.router_params[key]), value)
  assert os.path.exists(full / "tokenizer.json")
  # The routers-only export in their layout is there too (block 128 fits it).
  assert (run / "export" / "authors" / "config_extra.json").exists()
