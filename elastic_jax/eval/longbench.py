"""LongBench, LongBench-E and LongBench v2: local data files and the exact published model inputs.

The benchmark's specification (the prompt template and the number of new tokens of every task,
the tasks that skip the chat template, the v2 0-shot template, the reference truncation lengths)
is taken from THUDM/LongBench and kept as data in `longbench_prompts.json` next to this module;
its "source" entry names the files and the commit. This module reads the data files the user
has downloaded (it never downloads anything) and rebuilds, record by record, the text the
published evaluation feeds the model:

LongBench and LongBench-E (`LongBench/pred.py`):
  1. prompt = dataset2prompt[task].format(**record)
  2. ids = tokenizer(prompt) -- special tokens included (BOS for most tokenizers); only the
     chatglm3 branch passes add_special_tokens=False. If len(ids) > max_length, with
     half = int(max_length / 2): prompt = decode(ids[:half]) + decode(ids[-half:]), each half
     decoded separately with skip_special_tokens=True. So a BOS counts toward max_length and is
     then dropped, and an odd max_length keeps max_length - 1 tokens.
  3. Unless the task is one of trec, triviaqa, samsum, lsht, lcc, repobench-p, the prompt goes
     through `build_chat(tokenizer, prompt, model_name)`: a hand-written wrapper per model family
     ("[INST]...[/INST]" for llama2, fastchat's vicuna template, chatglm's own builders, ...);
     every model of the published list is a chat or instruction model, and an unknown model
     name leaves the prompt unchanged. Our generic rule instead: the tokenizer's own chat
     template, as one user turn with the generation prompt, when the tokenizer has one (or the
     caller asks for it) and the task is not excluded.
  4. Greedy decoding (num_beams=1, do_sample=False) of at most dataset2maxlen[task] new tokens;
     for samsum also at least one new token and a stop at the newline token, besides EOS.

LongBench v2 (`pred.py`, 0-shot without chain of thought):
  1. prompt = prompts/0shot.txt with $DOC$, $Q$, $C_A$ .. $C_D$ replaced, in that order, one
     `str.replace` after the other, by the stripped context, question and choices.
  2. ids = tokenizer.encode(prompt) (special tokens included); if len(ids) > max_len:
     ids = ids[:max_len // 2] + ids[-max_len // 2:] decoded at once with
     skip_special_tokens=True. Python reads `-max_len // 2` as `(-max_len) // 2`, so an odd
     max_len keeps one more token at the end than at the start. config/model2maxlen.json sets
     max_len = 120000 for every model but claude-3.5-sonnet (200000).
  3. The prompt is sent as the one user message of an OpenAI-compatible chat completion (the
     server applies the chat template; no task is excluded), temperature 0.1, at most 128 new
     tokens.

Data layout (the published files, unchanged): a directory holding `{task}.jsonl` (LongBench,
the data/ folder of the published data.zip) and/or `{task}_e.jsonl` (LongBench-E), one JSON
object a line with the fields input, context, answers, length, dataset, language, all_classes
and _id; and for v2 a directory holding the published `data.json`, a JSON list of objects with
_id, domain, sub_domain, difficulty, length, question, choice_A .. choice_D, answer, context.
Answers are kept on the records; scoring is `elastic_jax.eval.metrics`' job.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval.metrics import LONGBENCH_DATASETS, LONGBENCH_E_DATASETS
from elastic_jax.tokenizer import render_user_turn
from elastic_jax.files import text_lines

_SPEC = json.loads(Path(__file__).with_name("longbench_prompts.json").read_text("utf-8"))
_V1 = _SPEC["longbench"]
_V2 = _SPEC["longbench_v2"]

SOURCE: str = _SPEC["source"]
"""Where the published specification below comes from (repository, files, commit)."""

DATASETS: tuple[str, ...] = LONGBENCH_DATASETS
"""The 21 LongBench (v1) tasks (the metric table's order)."""

DATASETS_E: tuple[str, ...] = LONGBENCH_E_DATASETS
"""The 13 tasks that LongBench-E also has (files `{task}_e.jsonl`)."""

PROMPTS: Mapping[str, str] = MappingProxyType(dict(_V1["dataset2prompt"]))
"""dataset2prompt: the prompt template of each task, filled with `str.format(**record)`."""

MAX_NEW_TOKENS: Mapping[str, int] = MappingProxyType(dict(_V1["dataset2maxlen"]))
"""dataset2maxlen: the most new tokens generated for each task."""

NO_CHAT_DATASETS: frozenset[str] = frozenset(_V1["no_chat_template"])
"""Tasks whose prompt the published code never wraps for chat (few-shot and code tasks)."""

NEWLINE_STOP_DATASETS: frozenset[str] = frozenset(_V1["newline_stop"])
"""Tasks where generation also stops at the newline token and makes at least one token."""

MODEL_MAX_LENGTH: Mapping[str, int] = MappingProxyType(dict(_V1["model2maxlen"]))
"""LongBench's model2maxlen: the published `max_length` of each model it evaluated (reference)."""

V2_PROMPT: str = _V2["0shot"]
"""prompts/0shot.txt of LongBench v2, with the placeholders $DOC$, $Q$ and $C_A$ .. $C_D$."""

V2_MAX_NEW_TOKENS: int = _V2["max_new_tokens"]
"""The most new tokens of a v2 0-shot answer (pred.py without --cot)."""

V2_MODEL_MAX_LENGTH: Mapping[str, int] = MappingProxyType(dict(_V2["model2maxlen"]))
"""LongBench v2's model2maxlen: the truncation length of each model it evaluated (reference)."""

V2_DEFAULT_MAX_LENGTH = 120000
"""v2's truncation length for every model it lists but one (model2maxlen)."""
V1_MAX_LENGTH = 31500
"""LongBench's prompt truncation length (pred.py's max_length for 32K-context models)."""

V2_DIFFICULTIES: tuple[str, ...] = ("easy", "hard")
V2_LENGTHS: tuple[str, ...] = ("short", "medium", "long")
V2_ANSWERS: tuple[str, ...] = ("A", "B", "C", "D")


@dataclasses.dataclass(frozen=True)
class Record:
  """One LongBench or LongBench-E sample.

  dataset is the task named by the file (`hotpotqa` for both hotpotqa.jsonl and
  hotpotqa_e.jsonl): it selects the template, the generation length and the chat rule, as the
  published loop variable does. source is "file:line", for messages.
  """
  dataset: str
  id: str
  input: str
  context: str
  answers: tuple[str, ...]
  length: int
  language: str
  all_classes: tuple[str, ...] | None
  e: bool
  source: str

  def fields(self) -> dict:
    """The record under its published field names, as `template.format(**record)` sees it.

    The published templates use only {context} and {input}; "dataset" here is the task name.
    """
    return {"input": self.input, "context": self.context, "answers": list(self.answers),
            "length": self.length, "dataset": self.dataset, "language": self.language,
            "all_classes": None if self.all_classes is None else list(self.all_classes),
            "_id": self.id}


@dataclasses.dataclass(frozen=True)
class V2Record:
  """One LongBench v2 multiple-choice sample; choices are choice_A .. choice_D, answer a letter.

  source is "file, record N" (N counted from 1), for messages.
  """
  id: str
  domain: str
  sub_domain: str
  difficulty: str
  length: str
  question: str
  choices: tuple[str, str, str, str]
  answer: str
  context: str
  source: str


# ---------------------------------------------------------------------------------------- loading

_V1_STR_FIELDS = ("input", "context", "dataset", "language", "_id")
_V1_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes",
              "_id")
_V2_CHOICE_FIELDS = ("choice_A", "choice_B", "choice_C", "choice_D")
_V2_FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question",
              *_V2_CHOICE_FIELDS, "answer", "context")


def _check_limit(limit: int | None) -> None:
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
    raise ElasticJaxError(f"limit must be None or a positive integer, got {limit!r}")


def _names(value, what: str) -> list[str]:
  """A name or an iterable of names as a list without repeats (order kept)."""
  if isinstance(value, str):
    return [value]
  if not isinstance(value, Iterable):
    raise ElasticJaxError(f"{what} must be a name or a list of names, got {value!r}")
  out = []
  for name in value:
    if not isinstance(name, str):
      raise ElasticJaxError(f"{what} must be a name or a list of names, got {value!r}")
    if name not in out:
      out.append(name)
  return out


def _str_list(value) -> bool:
  return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _v1_problem(obj) -> str | None:
  """Why a parsed line is not a LongBench record, or None when it is one."""
  if not isinstance(obj, dict):
    return f"holds a JSON {type(obj).__name__}, not an object"
  for name in _V1_FIELDS:
    if name not in obj:
      return f"the record has no field '{name}'"
  for name in _V1_STR_FIELDS:
    if not isinstance(obj[name], str):
      return f"field '{name}' must be a string, got {type(obj[name]).__name__}"
  if not _str_list(obj["answers"]):
    return "field 'answers' must be a list of strings"
  if isinstance(obj["length"], bool) or not isinstance(obj["length"], int):
    return f"field 'length' must be an integer, got {type(obj['length']).__name__}"
  if obj["all_classes"] is not None and not _str_list(obj["all_classes"]):
    return "field 'all_classes' must be null or a list of strings"
  return None


def _read_jsonl(path: str, task: str, e: bool, limit: int | None) -> list[Record]:
  records = []
  where = lambda line_no: f"LongBench file '{path}', line {line_no}"
  for line_no, text in text_lines(path, where):
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as err:
      raise ElasticJaxError(f"{where(line_no)}: the line is not valid JSON ({err.msg} at "
                            f"column {err.colno})") from None
    problem = _v1_problem(obj)
    if problem is not None:
      raise ElasticJaxError(f"{where(line_no)}: {problem}")
    classes = obj["all_classes"]
    records.append(Record(
        dataset=task, id=obj["_id"], input=obj["input"], context=obj["context"],
        answers=tuple(obj["answers"]), length=obj["length"], language=obj["language"],
        all_classes=None if classes is None else tuple(classes), e=e,
        source=f"{path}:{line_no}"))
    if limit is not None and len(records) >= limit:
      break
  if not records:
    raise ElasticJaxError(f"LongBench file '{path}' holds no records")
  return records


def load_longbench(data_dir: str | os.PathLike, datasets: str | Iterable[str] | None = None, *,
                   e: bool = False, limit: int | None = None) -> list[Record]:
  """The records of LongBench tasks (or of LongBench-E with e=True), task after task.

  data_dir holds the published files `{task}.jsonl` (LongBench) or `{task}_e.jsonl`
  (LongBench-E). datasets: a task name or names (None: every task of the benchmark, in the
  published order). limit: at most this many records of each task, the first ones of its file.
  Every problem (missing directory or file, a line that is not JSON, a record without a field)
  raises ElasticJaxError naming the file, and the line when there is one.
  """
  _check_limit(limit)
  known = DATASETS_E if e else DATASETS
  bench = "LongBench-E" if e else "LongBench"
  names = list(known) if datasets is None else _names(datasets, "datasets")
  if not names:
    raise ElasticJaxError(f"no {bench} task was asked for (tasks: {', '.join(known)})")
  for name in names:
    if name not in known:
      extra = " (LongBench-E has 13 of LongBench's 21 tasks)" if e and name in DATASETS else ""
      raise ElasticJaxError(f"'{name}' is not a {bench} task{extra}; tasks: {', '.join(known)}")
  data_dir = os.fspath(data_dir)
  pattern = "data/*_e.jsonl files of LongBench-E" if e else "data/*.jsonl files of LongBench"
  if not os.path.isdir(data_dir):
    raise ElasticJaxError(f"{bench} directory '{data_dir}' not found: create it and put the "
                          f"published {pattern} (THUDM/LongBench) in it")
  records = []
  for name in names:
    path = os.path.join(data_dir, f"{name}_e.jsonl" if e else f"{name}.jsonl")
    if not os.path.isfile(path):
      raise ElasticJaxError(f"{bench} file '{path}' not found: put the published {pattern} "
                            f"(THUDM/LongBench) in {data_dir}")
    records.extend(_read_jsonl(path, name, e, limit))
  return records


def _filter_values(value, allowed: tuple[str, ...], what: str) -> frozenset[str] | None:
  if value is None:
    return None
  names = _names(value, what)
  for name in names:
    if name not in allowed:
      raise ElasticJaxError(f"{what} '{name}' is unknown (known: {', '.join(allowed)})")
  return frozenset(names)


def _v2_record(obj, path: str, index: int) -> V2Record:
  where = f"LongBench-v2 file '{path}', record {index}"
  if not isinstance(obj, dict):
    raise ElasticJaxError(f"{where}: holds a JSON {type(obj).__name__}, not an object")
  if isinstance(obj.get("_id"), str):
    where += f" (_id '{obj['_id']}')"
  for name in _V2_FIELDS:
    if name not in obj:
      raise ElasticJaxError(f"{where}: the record has no field '{name}'")
    if not isinstance(obj[name], str):
      raise ElasticJaxError(f"{where}: field '{name}' must be a string, got "
                            f"{type(obj[name]).__name__}")
  for name, allowed in (("difficulty", V2_DIFFICULTIES), ("length", V2_LENGTHS),
                        ("answer", V2_ANSWERS)):
    if obj[name] not in allowed:
      raise ElasticJaxError(f"{where}: field '{name}' is '{obj[name]}', not one of "
                            f"{', '.join(allowed)}")
  return V2Record(
      id=obj["_id"], domain=obj["domain"], sub_domain=obj["sub_domain"],
      difficulty=obj["difficulty"], length=obj["length"], question=obj["question"],
      choices=tuple(obj[name] for name in _V2_CHOICE_FIELDS), answer=obj["answer"],
      context=obj["context"], source=f"{path}, record {index}")


def load_longbench_v2(data_dir: str | os.PathLike, *, limit: int | None = None,
                      difficulty: str | Iterable[str] | None = None,
                      length: str | Iterable[str] | None = None) -> list[V2Record]:
  """The records of LongBench v2 from `data_dir/data.json`, in file order.

  difficulty ("easy", "hard") and length ("short", "medium", "long"): keep only records with
  one of these values (None: all). limit: at most this many of the records kept. Every record
  is checked (fields present and strings, difficulty/length/answer among the published values),
  filtered or not; a problem raises ElasticJaxError naming the file and the record.
  """
  _check_limit(limit)
  keep_difficulty = _filter_values(difficulty, V2_DIFFICULTIES, "difficulty")
  keep_length = _filter_values(length, V2_LENGTHS, "length")
  data_dir = os.fspath(data_dir)
  if not os.path.isdir(data_dir):
    raise ElasticJaxError(f"LongBench-v2 directory '{data_dir}' not found: create it and put "
                          f"the published data.json of THUDM/LongBench-v2 in it")
  path = os.path.join(data_dir, "data.json")
  if not os.path.isfile(path):
    raise ElasticJaxError(f"LongBench-v2 file '{path}' not found: put the published data.json "
                          f"of THUDM/LongBench-v2 in {data_dir}")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except UnicodeDecodeError as err:
    raise ElasticJaxError(f"LongBench-v2 file '{path}' is not valid UTF-8 (byte "
                          f"{err.start + 1})") from None
  except json.JSONDecodeError as err:
    raise ElasticJaxError(f"LongBench-v2 file '{path}' is not valid JSON ({err.msg} at line "
                          f"{err.lineno}, column {err.colno})") from None
  if not isinstance(data, list):
    raise ElasticJaxError(f"LongBench-v2 file '{path}' holds a JSON {type(data).__name__}, not "
                          f"the published list of records")
  if not data:
    raise ElasticJaxError(f"LongBench-v2 file '{path}' holds no records")
  records = []
  for index, obj in enumerate(data, start=1):
    record = _v2_record(obj, path, index)
    if keep_difficulty is not None and record.difficulty not in keep_difficulty:
      continue
    if keep_length is not None and record.length not in keep_length:
      continue
    if limit is None or len(records) < limit:
      records.append(record)
  return records


# ---------------------------------------------------------------------------------------- prompts

def build_prompt_v2(record: V2Record) -> str:
  """The v2 0-shot prompt: each placeholder replaced in the published order by the stripped
  field, one replacement after the other (so a placeholder written inside an earlier
  substitution, e.g. "$Q$" in a context, is replaced too, as published)."""
  prompt = V2_PROMPT
  pairs = (("$DOC$", record.context), ("$Q$", record.question), ("$C_A$", record.choices[0]),
           ("$C_B$", record.choices[1]), ("$C_C$", record.choices[2]),
           ("$C_D$", record.choices[3]))
  for placeholder, value in pairs:
    prompt = prompt.replace(placeholder, value.strip())
  return prompt


def build_prompt(record: Record | V2Record) -> str:
  """The untruncated prompt: `dataset2prompt[task].format(**record)` for LongBench and
  LongBench-E (context and input inserted verbatim), the 0-shot prompt for v2."""
  if isinstance(record, V2Record):
    return build_prompt_v2(record)
  if not isinstance(record, Record):
    raise ElasticJaxError(f"build_prompt takes a LongBench record, got {type(record).__name__}")
  if record.dataset not in PROMPTS:
    raise ElasticJaxError(f"'{record.dataset}' is not a LongBench task; tasks: "
                          f"{', '.join(DATASETS)}")
  return PROMPTS[record.dataset].format(**record.fields())


# ------------------------------------------------------------------------------------- truncation

def _check_max_length(max_length: int) -> None:
  # int(1 / 2) == 0 would make the published slice ids[-0:] keep every token: refused.
  if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
    raise ElasticJaxError(f"max_length must be an integer >= 2, got {max_length!r}")


def _token_ids(prompt: str, tokenizer, add_special_tokens: bool) -> list[int]:
  return list(tokenizer(prompt, add_special_tokens=add_special_tokens,
                        truncation=False)["input_ids"])


def truncate_middle(prompt: str, tokenizer, max_length: int, *,
                    add_special_tokens: bool = True) -> str:
  """LongBench's middle truncation: the prompt itself when it has at most max_length tokens,
  else the decoded first half of its tokens followed by the decoded last half.

  As in LongBench/pred.py: tokens are counted with the special tokens the tokenizer adds
  (add_special_tokens=False is the published chatglm3 branch), half = int(max_length / 2), and
  ids[:half] and ids[-half:] are decoded separately, skipping special tokens, and the two
  strings are concatenated.
  """
  _check_max_length(max_length)
  ids = _token_ids(prompt, tokenizer, add_special_tokens)
  if len(ids) <= max_length:
    return prompt
  half = int(max_length / 2)
  return (tokenizer.decode(ids[:half], skip_special_tokens=True)
          + tokenizer.decode(ids[-half:], skip_special_tokens=True))


def truncate_middle_v2(prompt: str, tokenizer, max_length: int) -> str:
  """LongBench v2's middle truncation (pred.py's query_llm, Hugging Face tokenizers).

  The prompt itself when `tokenizer.encode(prompt)` (special tokens included) has at most
  max_length tokens, else ids[:max_length // 2] + ids[-max_length // 2:] decoded as one sequence,
  skipping special tokens. The tail slice is Python's `(-max_length) // 2`: for an odd
  max_length the end keeps one token more than the start.
  """
  _check_max_length(max_length)
  ids = _token_ids(prompt, tokenizer, True)
  if len(ids) <= max_length:
    return prompt
  kept = ids[:max_length // 2] + ids[(-max_length) // 2:]
  return tokenizer.decode(kept, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------- chat

def _has_chat_template(tokenizer) -> bool:
  return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(record: Record | V2Record, tokenizer, chat: bool | None = None) -> bool:
  """Whether the prompt of this record is wrapped in the tokenizer's chat template.

  chat: None wraps when the tokenizer has a chat template; True requires one (ElasticJaxError
  without); False never wraps. The published exclusion holds on top: LongBench tasks trec,
  triviaqa, samsum, lsht, lcc and repobench-p are never wrapped. v2 has no exclusion (the
  published v2 always queries a chat endpoint).
  """
  if chat not in (None, True, False):
    raise ElasticJaxError(f"chat must be None, True or False, got {chat!r}")
  has_template = _has_chat_template(tokenizer)
  if chat is True and not has_template:
    raise ElasticJaxError("chat is True but the tokenizer has no chat template")
  if chat is False or not has_template:
    return False
  return isinstance(record, V2Record) or record.dataset not in NO_CHAT_DATASETS


def apply_chat_template(text: str, tokenizer) -> str:
  """text as the one user message of the tokenizer's chat template, with the generation prompt.

  The result usually holds the template's own BOS; tokenize it with add_special_tokens=False
  (see `input_ids`).
  """
  if not _has_chat_template(tokenizer):
    raise ElasticJaxError("the tokenizer has no chat template to apply")
  return render_user_turn(tokenizer, text)


def model_input(record: Record | V2Record, tokenizer, max_length: int,
                chat: bool | None = None) -> tuple[str, int, bool]:
  """(text, max_new_tokens, apply_chat): what the model is given for one record.

  text is the prompt after middle truncation to max_length tokens (`truncate_middle` for
  LongBench and LongBench-E, `truncate_middle_v2` for v2), wrapped in the chat template when
  apply_chat is True (`uses_chat_template`). Truncation is measured on the prompt without the
  chat template, as published, so the wrapped text is a few tokens longer than max_length.
  max_new_tokens is dataset2maxlen[task], or 128 for v2. Tokenize text with `input_ids`.
  """
  if isinstance(record, V2Record):
    text = truncate_middle_v2(build_prompt_v2(record), tokenizer, max_length)
    new_tokens = V2_MAX_NEW_TOKENS
  else:
    text = truncate_middle(build_prompt(record), tokenizer, max_length)
    new_tokens = MAX_NEW_TOKENS[record.dataset]
  apply_chat = uses_chat_template(record, tokenizer, chat)
  if apply_chat:
    text = apply_chat_template(text, tokenizer)
  return text, new_tokens, apply_chat


def input_ids(text: str, tokenizer, apply_chat: bool) -> list[int]:
  """The token ids of a `model_input` text.

  Without the chat template the tokenizer adds its special tokens (BOS), as the published
  code does; a rendered chat template already holds them, so none are added then.
  """
  return _token_ids(text, tokenizer, not apply_chat)


def extra_stop_ids(record: Record | V2Record, tokenizer) -> tuple[int, ...]:
  """Token ids that end generation besides EOS: for samsum the published code adds the last id
  of `tokenizer.encode("\\n", add_special_tokens=False)`; none for the other tasks."""
  if isinstance(record, Record) and record.dataset in NEWLINE_STOP_DATASETS:
    ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if not ids:
      raise ElasticJaxError("the tokenizer encodes a newline as no token")
    return (ids[-1],)
  return ()


def min_new_tokens(record: Record | V2Record) -> int:
  """The fewest new tokens: 1 for samsum (published min_length = prompt length + 1, which also
  keeps the newline stop from ending generation at once), else 0."""
  return 1 if isinstance(record, Record) and record.dataset in NEWLINE_STOP_DATASETS else 0

