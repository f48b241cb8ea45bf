"""Router-training data: JSONL records -> tokenized, packed, deterministic, resumable batches.

Records. One JSON object per line, {"context", "question", "answer", "task"}; task is one of the
authors' names ("Single QA", "MultiHop QA", "Summarization", "Code", "In-Context Learning") or
our ids (objective.TASK_TYPES), case-insensitive. Blank lines are ignored; any other bad line
fails with the file and its 1-based line number. A .parquet path (or a directory of them) is
the authors' own data, SFT records or their packed rows (train/authors_data.py).

Tokens of one record: prompt = prefix + context + question + suffix, then answer + EOS. With a
chat template the prompt is the user turn (context, a blank line, the question) rendered with
add_generation_prompt=True: prefix and suffix are what the template puts around the message.
Without one, prefix is the special tokens the tokenizer adds itself (BOS) and the pieces are
joined by PLAIN_SEPARATOR. Each piece is tokenized on its own, so no token straddles two pieces
and an over-long context can be cut by exact token counts ("truncate_middle" keeps its head and
tail; question and answer stay whole) or the record dropped ("skip").

Packing. Records, in the epoch's order, fill rows of seq_len tokens greedily (next fit): a row
closes when the next record does not fit or its max_segments - 1 segment slots are used. A
record is never split. The fields are those of train/step.py, dtypes as train/synthetic.py:
segment ids 1.. (0 = padding), positions from 0 in each segment, targets the next token of the
same segment, loss_mask on the positions whose target is an answer token (the answer and its
EOS: from the last prompt token to the one before EOS), prompt_mask on the prompt tokens (what
the router pools), task_ids [B, S] by segment slot (-1 = empty; slot 0 is padding).

Order. Epoch e visits the kept records in np.random.default_rng([seed, e]).permutation order;
the stream runs on across epochs (rows may hold records of two epochs). The whole position is
(epoch, index in the epoch), so `state()` is a small dict and `restore(state)` continues with
exactly the batches an uninterrupted run would yield. Every process walks the same global
batches of batch_size rows and builds only its own rows [p * B / P, (p + 1) * B / P); the global
batches do not depend on the process count, and a state saved by any process restores on all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Iterator

import numpy as np

from elastic_jax.errors import ElasticJaxError
from elastic_jax.files import text_lines
from elastic_jax.progress import progress
from elastic_jax.tasks import KNOWN_TASKS, TASK_IDS, TASK_TYPES
from elastic_jax.tokenizer import load_tokenizer, render_user_turn
from elastic_jax.train import authors_data
from elastic_jax.train.encoded import Encoded

log = logging.getLogger(__name__)

OVERLONG = ("truncate_middle", "skip")
MAX_UNKNOWN_SHARE = 0.05          # more unknown tokens than this: the wrong tokenizer
PLAIN_SEPARATOR = "\n\n"          # between context and question, and before the answer
FIELDS = ("context", "question", "answer", "task")
STATE_VERSION = 1
_CHUNK = 1024                     # records tokenized per call
_PROGRESS_MIN_CHARS = 20_000_000  # less text: no progress bar, only the log line
_MARKER = "\x00elastic-jax user message\x00"


@dataclasses.dataclass(frozen=True)
class Record:
  context: str
  question: str
  answer: str
  task_id: int                    # index into TASK_TYPES
  line: int                       # 1-based line in its file
  name: str | None = None         # the data's own name for the task (optional "name" field)


_JSON_TYPES = {dict: "an object", list: "an array", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _parse_line(text: str, line: int) -> Record | str:
  """The record on one line, or what is wrong with it."""
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    return f"is not valid JSON ({e.msg} at column {e.colno})"
  if not isinstance(obj, dict):
    kind = _JSON_TYPES.get(type(obj), "a string")
    return f"holds {kind}, not an object with fields {', '.join(FIELDS)}"
  for field in FIELDS:
    if field not in obj:
      return f"has no '{field}' field"
    if not isinstance(obj[field], str):
      return f"has field '{field}' as {_JSON_TYPES[type(obj[field])]}, not a string"
  context, question, answer = (obj[f].strip() for f in FIELDS[:3])
  if not answer:
    return "has an empty answer"
  if not context and not question:
    return "has an empty context and an empty question"
  tid = TASK_IDS.get(obj["task"].strip().lower())
  if tid is None:
    return f"has an unknown task '{obj['task']}' (known: {KNOWN_TASKS})"
  name = obj.get("name") if isinstance(obj.get("name"), str) else None
  return Record(context, question, answer, tid, line, name)


def read_records(path: str | os.PathLike) -> list[Record]:
  """All records of a JSONL file; a bad line raises ElasticJaxError naming path and line."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ElasticJaxError(f"{path}: no such data file")
  records = []
  for line_no, text in text_lines(path, lambda n: f"{path}:{n}"):
    parsed = _parse_line(text, line_no)
    if isinstance(parsed, str):
      raise ElasticJaxError(f"{path}:{line_no}: the line {parsed}")
    records.append(parsed)
  if not records:
    raise ElasticJaxError(f"{path}: holds no records")
  return records


@dataclasses.dataclass(frozen=True)
class PromptFormat:
  """Token ids around a prompt's pieces, and the text joining context and question."""
  prefix: tuple[int, ...]
  suffix: tuple[int, ...]
  separator: str
  chat: bool


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
  if not texts:
    return []
  return tokenizer(texts, add_special_tokens=False)["input_ids"]


def prompt_format(tokenizer, use_chat_template: bool | str = "auto") -> PromptFormat:
  """How prompts are framed: the chat template's user turn, or plain concatenation.

  use_chat_template: "auto" (the template when the tokenizer has one), True (required) or False.
  """
  if use_chat_template not in ("auto", True, False):
    raise ElasticJaxError(f"use_chat_template must be 'auto', True or False, got "
                          f"{use_chat_template!r}")
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if use_chat_template is True and not has_template:
    raise ElasticJaxError("use_chat_template is True but the tokenizer has no chat template")
  if has_template and use_chat_template is not False:
    parts = render_user_turn(tokenizer, _MARKER).split(_MARKER)
    if len(parts) != 2:
      raise ElasticJaxError("the tokenizer's chat template does not render the user message "
                            "verbatim exactly once")
    prefix, suffix = _ids(tokenizer, parts)
    return PromptFormat(tuple(prefix), tuple(suffix), PLAIN_SEPARATOR, True)
  # The special tokens the tokenizer adds on its own (BOS for most), found by difference.
  bare = tokenizer("a", add_special_tokens=False)["input_ids"]
  full = tokenizer("a", add_special_tokens=True)["input_ids"]
  start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
  return PromptFormat(tuple(full[:start]), tuple(_ids(tokenizer, [PLAIN_SEPARATOR])[0]),
                      PLAIN_SEPARATOR, False)


def encode_records(records: list[Record], tokenizer, seq_len: int, fmt: PromptFormat,
                   overlong: str = "truncate_middle", source: str = "records"
                   ) -> tuple[Encoded, dict[str, int]]:
  """Tokenizes records into prompt + answer + EOS, applying the over-long policy.

  Returns the kept records and counts: records_read, records_kept, truncated, skipped (over
  long; with truncate_middle only those too long even without their context), tokens,
  prompt_tokens, answer_tokens and context_tokens_cut.
  """
  if overlong not in OVERLONG:
    raise ElasticJaxError(f"overlong policy '{overlong}' is unknown (known: {OVERLONG})")
  eos = tokenizer.eos_token_id
  pre, suf = list(fmt.prefix), list(fmt.suffix)
  stats = dict(records_read=len(records), records_kept=0, truncated=0, skipped=0, tokens=0,
               prompt_tokens=0, answer_tokens=0, context_tokens_cut=0)
  pieces, prompt_len, task_ids = [], [], []
  chunks = [records[i:i + _CHUNK] for i in range(0, len(records), _CHUNK)]
  chars = sum(len(r.context) + len(r.question) + len(r.answer) for r in records)
  for chunk in progress(chunks, f"tokenizing {os.path.basename(source)} ({_CHUNK} records)",
                        unit="chunk", enabled=chars >= _PROGRESS_MIN_CHARS):
    ctx_ids = _ids(tokenizer, [r.context for r in chunk])
    q_ids = _ids(tokenizer, [fmt.separator + r.question if r.context and r.question
                             else r.question for r in chunk])
    ans_ids = _ids(tokenizer, [r.answer for r in chunk])
    for r, ctx, q, ans in zip(chunk, ctx_ids, q_ids, ans_ids):
      if not ans:
        raise ElasticJaxError(f"{source}:{r.line}: the answer tokenizes to no tokens")
      fixed = len(pre) + len(q) + len(suf) + len(ans) + 1
      if fixed + len(ctx) > seq_len:
        if overlong == "skip" or fixed > seq_len:
          stats["skipped"] += 1
          continue
        keep = seq_len - fixed
        stats["truncated"] += 1
        stats["context_tokens_cut"] += len(ctx) - keep
        ctx = ctx[:keep - keep // 2] + ctx[len(ctx) - keep // 2:]
      prompt = pre + ctx + q + suf
      if not prompt:
        raise ElasticJaxError(f"{source}:{r.line}: the prompt tokenizes to no tokens")
      pieces.append(np.asarray(prompt + ans + [eos], np.int32))
      prompt_len.append(len(prompt))
      task_ids.append(r.task_id)
      stats["prompt_tokens"] += len(prompt)
      stats["answer_tokens"] += len(ans) + 1
  stats["records_kept"] = len(pieces)
  stats["tokens"] = stats["prompt_tokens"] + stats["answer_tokens"]
  starts = np.zeros(len(pieces) + 1, np.int64)
  np.cumsum([len(p) for p in pieces], out=starts[1:])
  tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
  return Encoded(tokens, starts, np.asarray(prompt_len, np.int32),
                 np.asarray(task_ids, np.int32)), stats


def pack_rows(rows: list[list[int]], enc: Encoded, seq_len: int, max_segments: int,
              pad_id: int) -> dict[str, np.ndarray]:
  """Arrays of train/step.py's batch for rows of record indices (each row fits seq_len)."""
  b, t = len(rows), seq_len
  ids = np.full((b, t), pad_id, np.int32)
  targets = np.full((b, t), pad_id, np.int32)
  loss_mask = np.zeros((b, t), bool)
  prompt_mask = np.zeros((b, t), bool)
  segment_ids = np.zeros((b, t), np.int32)
  positions = np.zeros((b, t), np.int32)
  task_ids = np.full((b, max_segments), -1, np.int32)
  for i, row in enumerate(rows):
    off = 0
    for slot, rec in enumerate(row, start=1):
      tok = enc.tokens[enc.starts[rec]:enc.starts[rec + 1]]
      n, p = len(tok), int(enc.prompt_len[rec])
      end = off + n
      ids[i, off:end] = tok
      targets[i, off:end - 1] = tok[1:]
      if enc.targets is None:
        loss_mask[i, off + p - 1:end - 1] = True
      else:   # position t is trained when token t + 1 is a target
        loss_mask[i, off:end - 1] = enc.targets[enc.starts[rec] + 1:enc.starts[rec + 1]]
      prompt_mask[i, off:off + p] = True
      segment_ids[i, off:end] = slot
      positions[i, off:end] = np.arange(n, dtype=np.int32)
      task_ids[i, slot] = enc.task_ids[rec]
      off = end
  return {"input_ids": ids, "targets": targets, "loss_mask": loss_mask,
          "segment_ids": segment_ids, "positions": positions, "prompt_mask": prompt_mask,
          "task_ids": task_ids}


class TrainData:
  """Packed router-training batches from a JSONL file: an iterator with state() / restore().

  path: JSONL records; tokenizer: a local tokenizer directory or a loaded tokenizer.
  seq_len: tokens per row (T); batch_size: global rows per batch (B, divisible by
  process_count); max_segments: segment slots per row (S, as RouterConfig.max_segments; a row
  holds up to S - 1 records). overlong: "truncate_middle" or "skip". num_epochs: None runs
  forever; otherwise the stream ends after that many epochs, its last batch filled with empty
  rows. process_index / process_count: jax.process_index() / jax.process_count() in a
  multi-host run; each `next()` gives this process's [B / P, T] share of the next global batch.
  """

  def __init__(self, path: str | os.PathLike, tokenizer: Any, seq_len: int, batch_size: int,
               max_segments: int = 8, overlong: str = "truncate_middle", seed: int = 0,
               use_chat_template: bool | str = "auto", process_index: int = 0,
               process_count: int = 1, num_epochs: int | None = None):
    if seq_len < 2 or batch_size < 1 or max_segments < 2:
      raise ElasticJaxError(f"data needs seq_len >= 2, batch_size >= 1 and max_segments >= 2, "
                            f"got {seq_len}, {batch_size} and {max_segments}")
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ElasticJaxError(f"process_index {process_index} is not in [0, {process_count})")
    if batch_size % process_count:
      raise ElasticJaxError(f"global batch_size {batch_size} does not divide over "
                            f"{process_count} processes")
    if not isinstance(seed, int) or seed < 0:
      raise ElasticJaxError(f"data seed must be a non-negative integer, got {seed!r}")
    if num_epochs is not None and num_epochs < 1:
      raise ElasticJaxError(f"num_epochs must be None or >= 1, got {num_epochs}")
    path = os.fspath(path)
    self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
    self.max_segments, self.seed, self.num_epochs = max_segments, seed, num_epochs
    self.process_index, self.process_count = process_index, process_count
    if isinstance(tokenizer, (str, os.PathLike)):
      tokenizer = load_tokenizer(os.fspath(tokenizer))
    self.tokenizer = tokenizer
    self.format = prompt_format(self.tokenizer, use_chat_template)
    # The data's own names of its tasks ({task type: name}), for progress lines.
    self.task_names: dict[str, str] = {}
    if authors_data.is_authors_data(path):
      if overlong not in OVERLONG:
        raise ElasticJaxError(f"overlong policy '{overlong}' is unknown (known: {OVERLONG})")
      self.encoded, self._stats = authors_data.encode(path, self.tokenizer, seq_len, overlong,
                                                      use_chat_template)
    else:
      records = read_records(path)
      self.encoded, self._stats = encode_records(records, self.tokenizer, seq_len,
                                                 self.format, overlong, source=path)
      for r in records:
        if r.name:
          self.task_names.setdefault(TASK_TYPES[r.task_id], r.name)
    if not len(self.encoded):
      raise ElasticJaxError(f"{path}: none of its {self._stats['records_read']} records fits "
                            f"seq_len {seq_len} (overlong policy '{overlong}')")
    unk = getattr(self.tokenizer, "unk_token_id", None)
    if unk is not None and len(self.encoded.tokens):
      share = float(np.mean(self.encoded.tokens == unk))
      if share > MAX_UNKNOWN_SHARE:
        raise ElasticJaxError(
            f"{path}: {share:.0%} of its tokens are the tokenizer's unknown token "
            f"{self.tokenizer.unk_token!r}: the data and the tokenizer do not match")
    pad = self.tokenizer.pad_token_id
    self.pad_id = int(self.tokenizer.eos_token_id if pad is None else pad)
    self._lengths = self.encoded.lengths
    self._fingerprint = self._make_fingerprint(overlong)
    self._epoch, self._position, self._batches = 0, 0, 0
    self._order_epoch, self._order = -1, None
    s = self._stats
    log.info("%s: %d records read, %d kept, %d truncated, %d skipped; %d tokens (%.1f per "
             "record), %s prompts", path, s["records_read"], s["records_kept"], s["truncated"],
             s["skipped"], s["tokens"], s["tokens"] / s["records_kept"],
             "chat-template" if self.format.chat else "plain")

  def _make_fingerprint(self, overlong: str) -> str:
    h = hashlib.sha256(json.dumps([self.seq_len, self.batch_size, self.max_segments, self.seed,
                                   overlong, self.num_epochs]).encode())
    for a in (self.encoded.tokens, self.encoded.starts, self.encoded.prompt_len,
              self.encoded.task_ids, self.encoded.targets):
      if a is not None:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]

  @property
  def stats(self) -> dict[str, int]:
    """Counts from reading (see encode_records), plus the current epoch and batches yielded."""
    return {**self._stats, "epoch": self._epoch, "batches": self._batches}

  def state(self) -> dict[str, Any]:
    """The position after the last batch yielded: small and JSON-serialisable."""
    return {"version": STATE_VERSION, "epoch": self._epoch, "position": self._position,
            "batches": self._batches, "fingerprint": self._fingerprint}

  def restore(self, state: dict[str, Any]) -> TrainData:
    """Continues from `state` (of a TrainData on the same data and settings); returns self."""
    try:
      version, epoch, position, batches, fingerprint = (
          state[k] for k in ("version", "epoch", "position", "batches", "fingerprint"))
    except (KeyError, TypeError):
      raise ElasticJaxError(f"data state {state!r} is not one that TrainData.state() "
                            f"made") from None
    if version != STATE_VERSION:
      raise ElasticJaxError(f"data state version {version} is not {STATE_VERSION}")
    if fingerprint != self._fingerprint:
      raise ElasticJaxError(f"data state was saved for other data or settings than {self.path} "
                            f"with these arguments")
    if not (0 <= position < len(self.encoded) and epoch >= 0 and batches >= 0):
      raise ElasticJaxError(f"data state position {position} in epoch {epoch} is out of range")
    self._epoch, self._position, self._batches = int(epoch), int(position), int(batches)
    return self

  def _order_of(self, epoch: int) -> np.ndarray:
    if epoch != self._order_epoch:
      self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.encoded))
      self._order_epoch = epoch
    return self._order

  def _next_row(self) -> list[int]:
    """Record indices of the next row (next fit), advancing the position past them."""
    row, used = [], 0
    while len(row) < self.max_segments - 1:
      if self.num_epochs is not None and self._epoch >= self.num_epochs:
        break
      rec = int(self._order_of(self._epoch)[self._position])
      if used + self._lengths[rec] > self.seq_len:
        break
      row.append(rec)
      used += int(self._lengths[rec])
      self._position += 1
      if self._position == len(self.encoded):
        self._epoch, self._position = self._epoch + 1, 0
    return row

  def next_rows(self) -> list[list[int]]:
    """The next global batch as record indices per row (all processes agree); advances."""
    rows = [self._next_row() for _ in range(self.batch_size)]
    if not rows[0]:
      raise StopIteration
    self._batches += 1
    return rows

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = self.next_rows()
    share = self.batch_size // self.process_count
    mine = rows[self.process_index * share:(self.process_index + 1) * share]
    return pack_rows(mine, self.encoded, self.seq_len, self.max_segments, self.pad_id)
