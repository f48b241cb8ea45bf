"""LongBench (v1, LongBench-E) and LongBench-v2 scoring, as the published benchmarks define it.

The definitions follow the THUDM/LongBench repository (its v1 `metrics.py` and `eval.py`, its
v2 `pred.py` and `result.py`) down to their quirks, so that the numbers this project reports can
be put next to published ones: answer normalization, token F1, ROUGE-L from the `rouge` package,
the classification, retrieval, count and code-similarity rules, the dataset-to-metric table, the
first-line cut for few-shot datasets, rounding, the LongBench-E length buckets, and v2's answer
extraction and accuracy table. Where the published code has an edge that looks accidental
(a list edited while it is iterated, a recursion limit that turns long ROUGE inputs into zero),
the behaviour is kept and the function says so.

Every per-sample metric takes `(prediction, ground_truth)` and returns a float in [0, 1];
`score_longbench`, `score_longbench_e` and `score_longbench_v2` aggregate them into percentages.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import re
import string
from collections import Counter
from typing import Callable, Mapping, Sequence

import numpy as np

from elastic_jax.errors import ElasticJaxError


@functools.cache
def _jieba():
  """The jieba module (an optional dependency, imported on first use)."""
  try:
    import jieba
  except ImportError:
    raise ElasticJaxError("LongBench scoring needs jieba: pip install 'elastic-jax[eval]'"
                          ) from None
  # jieba announces its dictionary loading at DEBUG level on the first segmentation; the
  # evaluation output has no use for it.
  jieba.setLogLevel(logging.WARNING)
  return jieba


@functools.cache
def _rouge():
  """The rouge package's Rouge class (an optional dependency, imported on first use)."""
  try:
    from rouge import Rouge
  except ImportError:
    raise ElasticJaxError("LongBench scoring needs rouge: pip install 'elastic-jax[eval]'"
                          ) from None
  return Rouge

# --------------------------------------------------------------------------------------------
# Normalization

# The Chinese (full-width) punctuation LongBench strips in addition to `string.punctuation`.
# The ASCII "." at the end is part of the published set (redundant with string.punctuation).
_ZH_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』"
                   "【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


def normalize_answer(text: str) -> str:
  """English answer normalization (SQuAD style): lowercase, drop ASCII punctuation, replace the
  articles a/an/the by spaces, collapse whitespace to single spaces."""
  text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
  """Chinese answer normalization: lowercase, drop Chinese and ASCII punctuation, remove all
  whitespace (Chinese has no spaces between words, so none are kept).

  The punctuation set is the published one, gaps included: it has "》" but not "《".
  """
  text = "".join(ch for ch in text.lower() if ch not in _ZH_PUNCT)
  return "".join(text.split())


def _jieba_tokens(text: str) -> list[str]:
  """jieba's precise-mode segmentation (HMM on), the call LongBench makes."""
  return list(_jieba().cut(text, cut_all=False))


# --------------------------------------------------------------------------------------------
# Per-sample metrics


def _token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
  """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
  common = Counter(prediction) & Counter(ground_truth)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(prediction)
  recall = num_same / len(ground_truth)
  return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
  """Token F1 of the normalized English answer against one ground truth."""
  return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str) -> float:
  """Token F1 for Chinese answers over jieba words.

  As published, the raw text is segmented first and each word is normalized afterwards; words
  that normalize to nothing (punctuation, spaces) are dropped.
  """
  def tokens(text: str) -> list[str]:
    words = (normalize_zh_answer(w) for w in _jieba_tokens(text))
    return [w for w in words if w]
  return _token_f1(tokens(prediction), tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str) -> float:
  """ROUGE-L F of the `rouge` package (summary-level LCS over "."-split sentences, no case
  folding), or 0 when the package raises.

  The package raises on an empty prediction (nothing but dots and spaces) and, through Python's
  default recursion limit of 1000, when its recursive LCS reconstruction takes about a thousand
  steps (a prediction sentence of ~1000 words whose first word is its only match, say);
  LongBench counts all of these as 0, and so does this function. The limit is left as it is.
  """
  rouge = _rouge()
  try:
    scores = rouge().get_scores([prediction], [ground_truth], avg=True)
  except Exception:  # noqa: BLE001 - the published scorer maps every failure to 0
    return 0.0
  return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str) -> float:
  """ROUGE-L F over jieba words (the texts are re-joined with spaces for the `rouge` package)."""
  return rouge_score(" ".join(_jieba_tokens(prediction)), " ".join(_jieba_tokens(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
  """LongBench's partial-match accuracy for trec and lsht.

  Every class name that occurs as a substring of the prediction is a candidate; candidates that
  are substrings of the ground truth (but not the ground truth itself) are then discarded, so
  that "Other location" is not penalized for also containing "Other". The score is
  1 / (number of candidates) when the ground truth is among them, else 0.

  The published loop removes items from the candidate list while iterating over it, which skips
  the candidate right after each removal (it then survives even if it should have gone). The
  index walk below reproduces that on purpose: changing it would change published scores.
  """
  candidates = [name for name in all_classes if name in prediction]
  i = 0
  while i < len(candidates):
    name = candidates[i]
    if name in ground_truth and name != ground_truth:
      candidates.remove(name)
    i += 1
  if ground_truth in candidates:
    return 1.0 / len(candidates)
  return 0.0


def _number_hit_rate(prediction: str, target: str) -> float:
  """Fraction of the digit runs in the prediction that equal `target` (0 if there are none)."""
  numbers = _NUMBER.findall(prediction)
  if not numbers:
    return 0.0
  return sum(n == target for n in numbers) / len(numbers)


def _paragraph_id(ground_truth: str, pattern: re.Pattern[str]) -> str:
  match = pattern.search(ground_truth)
  if match is None:
    raise ElasticJaxError(f"retrieval ground truth {ground_truth!r} does not name a paragraph "
                          f"(expected a match of {pattern.pattern!r})")
  return match.group(1)


_PARAGRAPH_EN = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH = re.compile(r"段落(\d+)")


def retrieval_score(prediction: str, ground_truth: str) -> float:
  """passage_retrieval_en: the share of numbers in the prediction that equal N of the ground
  truth's "Paragraph N" (naming several paragraphs dilutes the score)."""
  return _number_hit_rate(prediction, _paragraph_id(ground_truth, _PARAGRAPH_EN))


def retrieval_zh_score(prediction: str, ground_truth: str) -> float:
  """passage_retrieval_zh: as `retrieval_score`, with the ground truth written "段落N"."""
  return _number_hit_rate(prediction, _paragraph_id(ground_truth, _PARAGRAPH_ZH))


def count_score(prediction: str, ground_truth: str) -> float:
  """passage_count: the share of numbers in the prediction that equal the ground-truth count."""
  return _number_hit_rate(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
  """`fuzzywuzzy.fuzz.ratio` as LongBench's published environment computes it, 0..100.

  LongBench's requirements install `fuzzywuzzy` without `python-Levenshtein`, and then
  fuzzywuzzy falls back to `difflib.SequenceMatcher` (Ratcliff/Obershelp matching, not an edit
  distance): round(100 * 2M / T), with 100 for equal strings and 0 when either is empty. With
  `python-Levenshtein` (or rapidfuzz/thefuzz) the same call returns an InDel ratio, which differs
  (e.g. "aba" vs "bca": 33 here, 67 there). The fallback is written out here rather than
  imported so that the number cannot change when some other package pulls in `Levenshtein`,
  and so that importing this module prints no fuzzywuzzy warning.
  """
  if a == b:
    return 100
  if not a or not b:
    return 0
  return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str) -> float:
  """lcc / repobench-p: similarity of the predicted next line of code to the ground truth.

  The predicted line is the first line (after leading newlines) that contains none of "`",
  "#" and "//" anywhere, so that code fences and comments are passed over (note: a line with a
  trailing comment is passed over too, as published). No such line means an empty prediction.
  """
  line = ""
  for candidate in prediction.lstrip("\n").split("\n"):
    if "`" not in candidate and "#" not in candidate and "//" not in candidate:
      line = candidate
      break
  return fuzz_ratio(line, ground_truth) / 100


# --------------------------------------------------------------------------------------------
# LongBench v1 tables

Metric = Callable[..., float]

# dataset -> (metric, category, language); the order is LongBench's own listing.
_DATASETS: dict[str, tuple[Metric, str, str]] = {
    "narrativeqa": (qa_f1_score, "Single-Doc QA", "en"),
    "qasper": (qa_f1_score, "Single-Doc QA", "en"),
    "multifieldqa_en": (qa_f1_score, "Single-Doc QA", "en"),
    "multifieldqa_zh": (qa_f1_zh_score, "Single-Doc QA", "zh"),
    "hotpotqa": (qa_f1_score, "Multi-Doc QA", "en"),
    "2wikimqa": (qa_f1_score, "Multi-Doc QA", "en"),
    "musique": (qa_f1_score, "Multi-Doc QA", "en"),
    "dureader": (rouge_zh_score, "Multi-Doc QA", "zh"),
    "gov_report": (rouge_score, "Summarization", "en"),
    "qmsum": (rouge_score, "Summarization", "en"),
    "multi_news": (rouge_score, "Summarization", "en"),
    "vcsum": (rouge_zh_score, "Summarization", "zh"),
    "trec": (classification_score, "Few-shot Learning", "en"),
    "triviaqa": (qa_f1_score, "Few-shot Learning", "en"),
    "samsum": (rouge_score, "Few-shot Learning", "en"),
    "lsht": (classification_score, "Few-shot Learning", "zh"),
    "passage_retrieval_en": (retrieval_score, "Synthetic", "en"),
    "passage_count": (count_score, "Synthetic", "en"),
    "passage_retrieval_zh": (retrieval_zh_score, "Synthetic", "zh"),
    "lcc": (code_sim_score, "Code", "code"),
    "repobench-p": (code_sim_score, "Code", "code"),
}

LONGBENCH_DATASETS: tuple[str, ...] = tuple(_DATASETS)
"""The 21 LongBench v1 datasets."""

LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
"""The 13 datasets LongBench-E provides (as `<name>_e`), all English or code."""

DATASET_METRIC: dict[str, Metric] = {name: row[0] for name, row in _DATASETS.items()}
"""Dataset name -> per-sample metric."""

DATASET_CATEGORY: dict[str, str] = {name: row[1] for name, row in _DATASETS.items()}
"""Dataset name -> task category of LongBench's leaderboard (the six groups)."""

DATASET_LANGUAGE: dict[str, str] = {name: row[2] for name, row in _DATASETS.items()}
"""Dataset name -> "en", "zh" or "code" (code tasks count towards both language tables)."""

CATEGORIES: tuple[str, ...] = ("Single-Doc QA", "Multi-Doc QA", "Summarization",
                               "Few-shot Learning", "Synthetic", "Code")

# Few-shot datasets whose answers are one line: only the prediction's first line is scored,
# since models tend to continue with further invented examples.
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

LONGBENCH_E_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def _check_dataset(dataset: str) -> None:
  if dataset not in _DATASETS:
    raise ElasticJaxError(f"unknown LongBench dataset {dataset!r}; the known datasets are "
                          f"{', '.join(LONGBENCH_DATASETS)}")


def prepare_prediction(dataset: str, prediction: str) -> str:
  """The part of a raw model output LongBench scores: the first line after leading newlines for
  trec/triviaqa/samsum/lsht, the whole output otherwise."""
  _check_dataset(dataset)
  if dataset in FIRST_LINE_DATASETS:
    return prediction.lstrip("\n").split("\n")[0]
  return prediction


def score_sample(dataset: str, prediction: str, ground_truths: Sequence[str],
                 all_classes: Sequence[str] | None = None) -> float:
  """One sample's score in [0, 1]: the dataset's metric on the prepared prediction, best over
  the ground truths (0 when there are none)."""
  _check_dataset(dataset)
  metric = DATASET_METRIC[dataset]
  if isinstance(ground_truths, str):
    raise ElasticJaxError(f"{dataset}: answers must be a list of strings per sample, "
                          f"got the string {ground_truths!r}")
  extra = {}
  if metric is classification_score:
    if not all_classes:
      raise ElasticJaxError(f"{dataset}: classification scoring needs all_classes, the list of "
                            f"class names of the dataset")
    extra["all_classes"] = all_classes
  prediction = prepare_prediction(dataset, prediction)
  best = 0.0
  for ground_truth in ground_truths:
    best = max(best, metric(prediction, ground_truth, **extra))
  return best


def _check_lengths(dataset: str, **columns: Sequence) -> int:
  sizes = {name: len(values) for name, values in columns.items()}
  if len(set(sizes.values())) != 1:
    raise ElasticJaxError(f"{dataset}: the per-sample lists differ in length "
                          f"({', '.join(f'{k}={v}' for k, v in sizes.items())})")
  n = next(iter(sizes.values()))
  if n == 0:
    raise ElasticJaxError(f"{dataset}: there are no samples to score")
  return n


def score_longbench(dataset: str, predictions: Sequence[str],
                    answers: Sequence[Sequence[str]],
                    all_classes: Sequence[str] | None = None) -> float:
  """A LongBench v1 dataset score: the mean per-sample score x 100, rounded to 2 decimals.

  `answers[i]` lists the ground truths of sample i; `all_classes` (trec, lsht) is the dataset's
  list of class names and is ignored elsewhere.
  """
  _check_dataset(dataset)
  n = _check_lengths(dataset, predictions=predictions, answers=answers)
  # A plain running sum, as published: builtin sum() of floats is compensated since Python 3.12
  # and could move the last digit.
  total = 0.0
  for prediction, ground_truths in zip(predictions, answers):
    total += score_sample(dataset, prediction, ground_truths, all_classes)
  return round(100 * total / n, 2)


def longbench_e_bucket(length: int) -> str:
  """LongBench-E's length bucket of a sample from its `length` field (words for English and
  code, characters for Chinese): "0-4k" below 4000, "4-8k" below 8000, else "8k+"."""
  if length < 4000:
    return "0-4k"
  if length < 8000:
    return "4-8k"
  return "8k+"


def score_longbench_e(dataset: str, predictions: Sequence[str],
                      answers: Sequence[Sequence[str]], lengths: Sequence[int],
                      all_classes: Sequence[str] | None = None) -> dict[str, float]:
  """A LongBench-E dataset score per length bucket: {"0-4k": x, "4-8k": y, "8k+": z}.

  Each value is 100 x the bucket's mean per-sample score rounded to 2 decimals (numpy's mean
  and rounding, as published); a bucket without samples is NaN, which is what the published
  script writes for it too.
  """
  _check_dataset(dataset)
  _check_lengths(dataset, predictions=predictions, answers=answers, lengths=lengths)
  buckets: dict[str, list[float]] = {name: [] for name in LONGBENCH_E_BUCKETS}
  for prediction, ground_truths, length in zip(predictions, answers, lengths):
    buckets[longbench_e_bucket(length)].append(
        score_sample(dataset, prediction, ground_truths, all_classes))
  return {name: float(np.round(100 * np.mean(scores), 2)) if scores else math.nan
          for name, scores in buckets.items()}


# --------------------------------------------------------------------------------------------
# LongBench v2

_CHOICE_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_CHOICE_BARE = re.compile(r"The correct answer is ([A-D])")

V2_DIFFICULTIES: tuple[str, ...] = ("easy", "hard")
V2_LENGTHS: tuple[str, ...] = ("short", "medium", "long")


def extract_choice(response: str) -> str | None:
  """The letter A-D of "The correct answer is (X)" in a LongBench-v2 response, else of
  "The correct answer is X", else None.

  Markdown emphasis ("*") is removed first, so "**The correct answer is (B)**" counts; the
  phrase is matched case-sensitively, and the first occurrence of the parenthesized form wins
  over any bare one.
  """
  response = response.replace("*", "")
  for pattern in (_CHOICE_PAREN, _CHOICE_BARE):
    match = pattern.search(response)
    if match:
      return match.group(1)
  return None


def score_longbench_v2(records: Sequence[Mapping[str, str]], responses: Sequence[str],
                       compensated: bool = False) -> dict[str, float]:
  """LongBench-v2 accuracy table in percent, rounded to 1 decimal as the published results are.

  `records[i]` is the dataset item (its "answer", "difficulty" and "length" fields are used)
  and `responses[i]` the model's final response to it. Returns the keys "overall", "easy",
  "hard", "short", "medium", "long"; a group without samples is NaN. With `compensated`, a
  response with no extractable answer counts 0.25 (chance level), the published script's
  optional setting; by default it counts 0.
  """
  if len(records) != len(responses):
    raise ElasticJaxError(f"LongBench-v2: {len(records)} records but {len(responses)} responses")
  if not records:
    raise ElasticJaxError("LongBench-v2: there are no samples to score")
  groups = ("overall",) + V2_DIFFICULTIES + V2_LENGTHS
  hits = dict.fromkeys(groups, 0.0)
  counts = dict.fromkeys(groups, 0)
  for i, (record, response) in enumerate(zip(records, responses)):
    difficulty, length = record.get("difficulty"), record.get("length")
    if difficulty not in V2_DIFFICULTIES or length not in V2_LENGTHS:
      raise ElasticJaxError(f"LongBench-v2 record {i}: difficulty {difficulty!r} / length "
                            f"{length!r} are not one of {V2_DIFFICULTIES} / {V2_LENGTHS}")
    if record.get("answer") not in ("A", "B", "C", "D"):
      raise ElasticJaxError(f"LongBench-v2 record {i}: answer {record.get('answer')!r} is not "
                            f"one of A, B, C, D")
    choice = extract_choice(response)
    if choice is None and compensated:
      hit = 0.25
    else:
      hit = float(choice == record["answer"])
    for group in ("overall", difficulty, length):
      hits[group] += hit
      counts[group] += 1
  return {group: round(100 * hits[group] / counts[group], 1) if counts[group] else math.nan
          for group in groups}
