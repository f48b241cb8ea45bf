"""The authors' training data, as they publish it: parquet files, read into our `Encoded`.

Two layouts are read (a .parquet file, or a directory of them, as their packer takes):

SFT records  columns context, question, answer, metadata; metadata (an object, or its Python
             literal as a string) holds `task` (their task names: Single QA, MultiHop QA,
             Summarization, Code, In-Context Learning) and `is_prefix` (default true: the
             question comes before the context). Each record is rendered as their packer
             does: the user message "\\n" + question, "\\n", "\\n" + context (or the other
             order), with their instruction in front for Summarization ("You are given several
             news passages. ...", and "\\n\\nSummary:" after) and Code ("Please complete the
             code given below."); the tokenizer's chat template (enable_thinking off) renders
             the user turn, whose tokens are the prompt the router pools, and the user plus
             assistant turns, the whole record; EOS is appended if the template did not end
             with it. The loss covers everything after the user turn. A tokenizer without a
             chat template gets plain text: its own special tokens, the user message, a blank
             line, the answer and EOS.
Packed rows  their packer's cache (columns input_ids, labels, seq_lengths, task_ids,
             range_ids): each row holds several samples, seq_lengths their cumulative
             boundaries, range_ids per sample their token ranges (positions 2..5: the user
             text, what their router pools), labels -100 where no loss is taken. Each sample
             becomes one record again (its prompt the user text, its loss where its labels
             are set), and our packer makes rows of data.seq_len from them.

Records too long for seq_len follow data.overlong: "skip" (their packer's rule) or
"truncate_middle" (the middle of the prompt is cut, its head and tail kept).
"""

from __future__ import annotations

import ast
import glob
import json
import os
from typing import Any

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.train.encoded import Encoded

AUTHORS_TASKS = ("Single QA", "MultiHop QA", "Summarization", "Code", "In-Context Learning")
SUMMARY_INSTRUCTION = ("You are given several news passages. Write a one-page summary of all "
                       "news.")
SUMMARY_SUFFIX = "\n\nSummary:"
CODE_INSTRUCTION = "Please complete the code given below."
SFT_COLUMNS = ("context", "question", "answer", "metadata")
PACKED_COLUMNS = ("input_ids", "labels", "seq_lengths", "task_ids", "range_ids")
IGNORE = -100


def is_authors_data(path: str) -> bool:
  """A parquet file, or a directory holding parquet files."""
  return path.endswith(".parquet") or (os.path.isdir(path)
                                       and bool(glob.glob(os.path.join(path, "*.parquet"))))


def _read_table(path: str):
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ElasticJaxError("reading the authors' parquet data needs pyarrow: pip install "
                          "'elastic-jax[data]'") from None
  files = (sorted(glob.glob(os.path.join(path, "*.parquet"))) if os.path.isdir(path)
           else [path])
  if not files or not all(os.path.isfile(f) for f in files):
    raise ElasticJaxError(f"{path}: no such parquet file")
  tables = []
  for f in files:
    try:
      tables.append((f, pq.read_table(f)))
    except Exception as e:  # pyarrow raises several types for damaged files
      raise ElasticJaxError(f"{f}: not a readable parquet file ({e})") from None
  return tables


def _task_id(name: Any, where: str) -> int:
  if isinstance(name, str) and name.strip() in AUTHORS_TASKS:
    return AUTHORS_TASKS.index(name.strip())
  raise ElasticJaxError(f"{where}: task {name!r} is none of the five task types training "
                        f"needs ({', '.join(AUTHORS_TASKS)})")


def _metadata(meta: Any, where: str) -> dict:
  if meta is None:
    return {}
  if isinstance(meta, str):
    try:
      meta = json.loads(meta)
    except json.JSONDecodeError:
      try:
        meta = ast.literal_eval(meta)   # their files' Python literal; nothing is executed
      except (ValueError, SyntaxError):
        raise ElasticJaxError(f"{where}: metadata is not an object, nor its JSON or Python "
                              "literal") from None
  if not isinstance(meta, dict):
    raise ElasticJaxError(f"{where}: metadata is {type(meta).__name__}, not an object")
  return meta


def user_message(context: str, question: str, task: str, is_prefix: bool) -> str:
  """The user turn's text, composed as the authors' packer composes it."""
  ctx = "\n" + context.replace("\ufeff", "").rstrip()
  q = "\n" + question.replace("\ufeff", "").lstrip()
  text = q + "\n" + ctx if is_prefix else ctx + "\n" + q
  if task == "Summarization":
    text = SUMMARY_INSTRUCTION + text + SUMMARY_SUFFIX
  elif task == "Code":
    text = CODE_INSTRUCTION + text
  return text


def _render(tokenizer, user: str, answer: str, chat: bool) -> tuple[list[int], int]:
  """(token ids of the record, prompt length) the way the authors' packer tokenizes."""
  eos = tokenizer.eos_token_id
  if chat:
    messages = [{"role": "user", "content": user}]
    try:
      user_text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
      full_text = tokenizer.apply_chat_template(
          messages + [{"role": "assistant", "content": answer}], tokenize=False,
          enable_thinking=False)
    except Exception as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ElasticJaxError(f"the tokenizer's chat template cannot be rendered ({first})"
                            ) from e
    prompt_len = len(tokenizer(user_text, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(full_text, add_special_tokens=False)["input_ids"])
  else:
    prompt = tokenizer(user, add_special_tokens=True)["input_ids"]
    prompt = list(prompt) + tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    prompt_len = len(prompt)
    ids = prompt + list(tokenizer(answer, add_special_tokens=False)["input_ids"])
  if eos is not None and (not ids or ids[-1] != eos):
    ids.append(eos)
  return ids, prompt_len


def _fit(ids: np.ndarray, prompt_len: int, targets: np.ndarray, seq_len: int,
         overlong: str, stats: dict) -> tuple[np.ndarray, int, np.ndarray] | None:
  """The record within seq_len by the over-long policy, or None to skip it."""
  if len(ids) <= seq_len:
    return ids, prompt_len, targets
  cut = len(ids) - seq_len
  if overlong == "skip" or cut >= prompt_len - 1:
    stats["skipped"] += 1
    return None
  keep = prompt_len - cut
  head, tail = keep - keep // 2, keep // 2
  idx = np.r_[0:head, prompt_len - tail:len(ids)]
  stats["truncated"] += 1
  stats["context_tokens_cut"] += cut
  return ids[idx], keep, targets[idx]


def encode(path: str, tokenizer, seq_len: int, overlong: str = "truncate_middle",
           use_chat_template: bool | str = "auto"):
  """The records of the authors' parquet data as (Encoded, stats), as encode_records gives
  for JSONL. Encoded.targets marks the tokens the loss predicts."""
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if use_chat_template is True and not has_template:
    raise ElasticJaxError("use_chat_template is True but the tokenizer has no chat template")
  chat = has_template and use_chat_template is not False
  stats = dict(records_read=0, records_kept=0, truncated=0, skipped=0, tokens=0,
               prompt_tokens=0, answer_tokens=0, context_tokens_cut=0)
  pieces, prompt_lens, task_ids, targets = [], [], [], []

  def add(ids, prompt_len, target, task, where):
    stats["records_read"] += 1
    if prompt_len < 1 or not target[prompt_len:].any():
      raise ElasticJaxError(f"{where}: the sample has no prompt or no answer tokens")
    fitted = _fit(np.asarray(ids, np.int32), prompt_len, target, seq_len, overlong, stats)
    if fitted is None:
      return
    ids, prompt_len, target = fitted
    pieces.append(ids)
    prompt_lens.append(prompt_len)
    targets.append(target)
    task_ids.append(task)
    stats["prompt_tokens"] += prompt_len
    stats["answer_tokens"] += len(ids) - prompt_len

  for fname, table in _read_table(path):
    columns = set(table.column_names)
    if set(PACKED_COLUMNS) <= columns:
      _packed_rows(table, fname, add)
    elif set(SFT_COLUMNS) <= columns:
      _sft_records(table, fname, tokenizer, chat, add)
    else:
      raise ElasticJaxError(
          f"{fname}: neither the authors' SFT records (columns {', '.join(SFT_COLUMNS)}) nor "
          f"their packed rows (columns {', '.join(PACKED_COLUMNS)}); it has "
          f"{', '.join(sorted(columns)) or 'no columns'}")
  stats["records_kept"] = len(pieces)
  stats["tokens"] = stats["prompt_tokens"] + stats["answer_tokens"]
  starts = np.zeros(len(pieces) + 1, np.int64)
  np.cumsum([len(p) for p in pieces], out=starts[1:])
  cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
  return Encoded(cat(pieces, np.int32), starts, np.asarray(prompt_lens, np.int32),
                 np.asarray(task_ids, np.int32), cat(targets, bool)), stats


def _sft_records(table, fname, tokenizer, chat, add) -> None:
  rows = table.select(list(SFT_COLUMNS)).to_pylist()
  for r, row in enumerate(rows):
    where = f"{fname}: record {r}"
    meta = _metadata(row["metadata"], where)
    task = _task_id(meta.get("task", "Other"), where)
    is_prefix = meta.get("is_prefix", True)
    texts = [row[k] or "" for k in ("context", "question", "answer")]
    if not all(isinstance(t, str) for t in texts):
      raise ElasticJaxError(f"{where}: context, question and answer must be strings")
    user = user_message(texts[0], texts[1], AUTHORS_TASKS[task], bool(is_prefix))
    answer = texts[2].replace("\ufeff", "")
    if not answer.strip():
      raise ElasticJaxError(f"{where}: the answer is empty")
    ids, prompt_len = _render(tokenizer, user, answer, chat)
    target = np.zeros(len(ids), bool)
    target[prompt_len:] = True
    add(ids, prompt_len, target, task, where)


def _packed_rows(table, fname, add) -> None:
  rows = table.select(list(PACKED_COLUMNS)).to_pylist()
  for r, row in enumerate(rows):
    ids = np.asarray(row["input_ids"], np.int64)
    labels = np.asarray(row["labels"], np.int64)
    bounds = list(row["seq_lengths"])
    tasks, ranges = list(row["task_ids"]), list(row["range_ids"])
    where = f"{fname}: row {r}"
    if len(labels) != len(ids) or not bounds or bounds[0] != 0 or bounds[-1] != len(ids) or \
        any(b >= a for a, b in zip(bounds[1:], bounds[:-1])):
      raise ElasticJaxError(f"{where}: seq_lengths {bounds[:4]}... do not split its "
                            f"{len(ids)} tokens into samples (cumulative, from 0)")
    n = len(bounds) - 1
    if len(tasks) != n or len(ranges) != n:
      raise ElasticJaxError(f"{where}: {n} samples but {len(tasks)} task ids and "
                            f"{len(ranges)} range_ids")
    for s in range(n):
      lo, hi = bounds[s], bounds[s + 1]
      rng = list(ranges[s])
      if len(rng) != 8:
        raise ElasticJaxError(f"{where} sample {s}: range_ids has {len(rng)} entries, not 8")
      task = tasks[s]
      if not isinstance(task, int) or not 0 <= task < len(AUTHORS_TASKS):
        raise ElasticJaxError(f"{where} sample {s}: task id {task!r} is none of the five task "
                              f"types training needs (0-4: {', '.join(AUTHORS_TASKS)})")
      start, end = rng[2], rng[5]           # the user text: what their router pools
      if start != 0 or not 0 <= end < hi - lo - 1:
        raise ElasticJaxError(f"{where} sample {s}: range_ids {rng} does not mark a prompt "
                              f"at the start of its {hi - lo} tokens")
      seg_labels = labels[lo:hi]
      target = seg_labels != IGNORE
      target[0] = False                     # the first token is never predicted
      add(ids[lo:hi], end + 1, target, task, f"{where} sample {s}")
