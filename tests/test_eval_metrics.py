"""LongBench / LongBench-E / LongBench-v2 scoring against hand-computed cases.

Every expected number is worked out in a comment from the metric's definition; the Chinese cases
first pin jieba's segmentation of the strings they use, so that a dictionary change shows up as
such rather than as a wrong score.
"""

from __future__ import annotations

import difflib
import math
import os
import subprocess
import sys
import warnings

import jieba
import pytest

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import metrics as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREC_CLASSES = ["City", "Country", "Other", "Other location", "Oth"]


def test_import_prints_nothing():
  """Importing the module (and so rouge and jieba) emits no warning, even with -W error."""
  proc = subprocess.run([sys.executable, "-W", "error", "-c", "import elastic_jax.eval.metrics"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ""


# --------------------------------------------------------------------------------------------
# Normalization and token F1


def test_normalize_answer():
  # lower -> "the cat's  hat, an apple!"; punctuation -> "the cats  hat an apple";
  # articles -> " cats  hat   apple"; whitespace -> "cats hat apple"
  assert M.normalize_answer("The Cat's  hat, an apple!") == "cats hat apple"
  # articles only as whole words: "theater" and "another" stay
  assert M.normalize_answer("Another theater") == "another theater"


def test_normalize_zh_answer():
  # lower, drop "," and "！", drop all whitespace; articles are not touched
  assert M.normalize_zh_answer("Hello, 世界！ A b") == "hello世界ab"
  # the published punctuation set has "》" but not "《", so the opening mark stays
  assert M.normalize_zh_answer("《红楼梦》。") == "《红楼梦"


def test_qa_f1_score():
  # pred [eiffel, tower, in, paris], gt [paris]: P = 1/4, R = 1, F1 = 2*(1/4)/(5/4) = 0.4
  assert M.qa_f1_score("The Eiffel Tower in Paris", "Paris") == pytest.approx(0.4)
  # gt [paris, france]: P = 1/4, R = 1/2, F1 = 2*(1/8)/(3/4) = 1/3
  assert M.qa_f1_score("The Eiffel Tower in Paris", "Paris, France") == pytest.approx(1 / 3)
  # multiset overlap: pred [yes, yes, no], gt [yes] share one "yes": P = 1/3, R = 1, F1 = 0.5
  assert M.qa_f1_score("yes yes no", "yes") == pytest.approx(0.5)
  assert M.qa_f1_score("London", "Paris") == 0.0
  # both normalize to nothing: no shared token, 0 (not a division by zero)
  assert M.qa_f1_score("The", "the") == 0.0


def test_qa_f1_zh_score():
  assert list(jieba.cut("我爱北京天安门")) == ["我", "爱", "北京", "天安门"]
  assert list(jieba.cut("北京是中国的首都")) == ["北京", "是", "中国", "的", "首都"]
  assert list(jieba.cut("中国的首都是北京。")) == ["中国", "的", "首都", "是", "北京", "。"]
  assert list(jieba.cut("首都北京")) == ["首都北京"]
  # [我, 爱, 北京, 天安门] vs [北京]: P = 1/4, R = 1, F1 = 0.4
  assert M.qa_f1_zh_score("我爱北京天安门", "北京") == pytest.approx(0.4)
  # same five words in another order; "。" normalizes to "" and is dropped: F1 = 1
  assert M.qa_f1_zh_score("北京是中国的首都", "中国的首都是北京。") == pytest.approx(1.0)
  # "首都北京" is one jieba word, which is not "北京"
  assert M.qa_f1_zh_score("首都北京", "北京") == 0.0
  # segmentation comes before normalization: the comma splits [首都, ，, 北京] -> [首都, 北京],
  # P = 1/2, R = 1, F1 = 2/3 (normalizing first would give "首都北京", one word, F1 = 0)
  assert list(jieba.cut("首都，北京")) == ["首都", "，", "北京"]
  assert M.qa_f1_zh_score("首都，北京", "北京") == pytest.approx(2 / 3)


# --------------------------------------------------------------------------------------------
# ROUGE-L


def test_rouge_score():
  # one sentence each, distinct words: F = 2*LCS/(|pred| + |ref|) (the package adds 1e-8 to the
  # denominator of 2PR/(P+R)). LCS of [cat sat quietly on mat today] and [the cat sat on mat]
  # is [cat sat on mat] = 4: F = 8/11
  assert M.rouge_score("cat sat quietly on mat today", "the cat sat on mat") == pytest.approx(
      8 / 11, rel=1e-6)
  # no case folding: only "sat" is shared, F = 2*1/(2+2) = 0.5
  assert M.rouge_score("Cat sat", "cat sat") == pytest.approx(0.5, rel=1e-6)
  # the package raises on an empty hypothesis; LongBench scores it 0
  assert M.rouge_score("", "the cat sat") == 0.0
  assert M.rouge_score("...", "the cat sat") == 0.0


def test_rouge_score_is_zero_where_the_package_overflows_the_stack():
  # The package rebuilds the LCS with one recursive call per step back from the end of the
  # prediction. A 1000-word prediction sharing only its last word with the reference
  # needs one step: F = 2*1/(1000+1). Sharing only its first word needs about 1000 steps, over
  # Python's default recursion limit; the package raises and LongBench's scorer gives 0.
  assert sys.getrecursionlimit() <= 1000
  pred = " ".join(f"w{i}" for i in range(1000))
  assert M.rouge_score(pred, "w999") == pytest.approx(2 / 1001, rel=1e-6)
  assert M.rouge_score(pred, "w0") == 0.0
  # a 500-word prediction stays within the limit: F = 2*1/(500+1)
  assert M.rouge_score(" ".join(f"w{i}" for i in range(500)), "w0") == pytest.approx(
      2 / 501, rel=1e-6)


def test_rouge_zh_score():
  assert list(jieba.cut("会议讨论了预算问题")) == ["会议", "讨论", "了", "预算", "问题"]
  assert list(jieba.cut("会议讨论预算")) == ["会议", "讨论", "预算"]
  # LCS [会议 讨论 预算] = 3 of 5 and 3 words: F = 2*3/(5+3) = 0.75
  assert M.rouge_zh_score("会议讨论了预算问题", "会议讨论预算") == pytest.approx(0.75, rel=1e-6)
  # without the jieba join the whole string is one "word" and nothing matches
  assert M.rouge_score("会议讨论了预算问题", "会议讨论预算") == 0.0


# --------------------------------------------------------------------------------------------
# Classification, retrieval, count


def test_classification_score():
  # candidates [City, Country] both occur in the prediction, the ground truth is one: 1/2
  assert M.classification_score("City or Country", "City", TREC_CLASSES) == 0.5
  # candidates [Other, Other location]; "Other" is part of the ground truth and goes: 1/1
  assert M.classification_score("Other location", "Other location", TREC_CLASSES) == 1.0
  # the ground truth is not mentioned: 0
  assert M.classification_score("Country", "City", TREC_CLASSES) == 0.0
  assert M.classification_score("no idea", "City", TREC_CLASSES) == 0.0


def test_classification_score_keeps_the_published_removal_skip():
  # Candidates follow the order of all_classes. [Other, Other location, Oth]: "Other" (index 0)
  # is removed, the list becomes [Other location, Oth], the walk goes on at index 1 ("Oth"),
  # removes it too -> [Other location]: 1/1.
  assert M.classification_score("Other location", "Other location", TREC_CLASSES) == 1.0
  # [Other, Oth, Other location]: removing "Other" gives [Oth, Other location] and the walk
  # goes on at index 1 ("Other location"), so "Oth" is skipped and survives: 1/2, where a
  # clean filter would give 1/1.
  classes = ["Other", "Oth", "Other location"]
  assert M.classification_score("Other location", "Other location", classes) == 0.5


def test_retrieval_scores():
  assert M.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
  # numbers [3, 12], one is right: 1/2
  assert M.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 3") == 0.5
  # whole digit runs are compared: "13" is not "3"
  assert M.retrieval_score("Paragraph 13", "Paragraph 3") == 0.0
  assert M.retrieval_score("I do not know", "Paragraph 3") == 0.0
  assert M.retrieval_zh_score("答案是段落3", "段落3") == 1.0
  assert M.retrieval_zh_score("段落3和段落13", "段落3") == 0.5
  with pytest.raises(ElasticJaxError, match="does not name a paragraph"):
    M.retrieval_score("Paragraph 3", "the third one")


def test_count_score():
  # numbers [7, 12]: 1/2
  assert M.count_score("There are 7 unique paragraphs out of 12", "7") == 0.5
  assert M.count_score("7", "7") == 1.0
  assert M.count_score("17", "7") == 0.0
  assert M.count_score("seven", "7") == 0.0


# --------------------------------------------------------------------------------------------
# Code similarity


def test_fuzz_ratio_is_the_difflib_one():
  # "abcd"/"abce": matching "abc", 2*3/8 = 0.75 -> 75
  assert M.fuzz_ratio("abcd", "abce") == 75
  # "abc"/"abd": 2*2/6 = 66.7 -> 67
  assert M.fuzz_ratio("abc", "abd") == 67
  # "return x"/"return y": 2*7/16 = 87.5 -> round half to even -> 88
  assert M.fuzz_ratio("return x", "return y") == 88
  # Ratcliff/Obershelp takes the leftmost longest block "a" (a[0] = b[2]) and then finds
  # nothing either side: 2*1/6 -> 33. An LCS/InDel ratio (python-Levenshtein, rapidfuzz)
  # would find "ba" and give 2*2/6 -> 67.
  assert M.fuzz_ratio("aba", "bca") == 33
  assert M.fuzz_ratio("", "") == 100
  assert M.fuzz_ratio("", "x") == 0


def test_fuzz_ratio_matches_fuzzywuzzy_without_levenshtein():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fuzzywuzzy import fuzz
  if fuzz.SequenceMatcher is not difflib.SequenceMatcher:
    pytest.skip("fuzzywuzzy here uses python-Levenshtein, not the published difflib path")
  pairs = [("aba", "bca"), ("return x", "return y"), ("", ""), ("", "a"),
           ("for i in range(10):", "for j in range(n):"),
           ("self.assertEqual(a, b)", "assertEqual(b, a)"), ("x" * 250, "x" * 200 + "y" * 50)]
  for a, b in pairs:
    assert M.fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


def test_code_sim_score():
  # fences and comment lines are passed over; the first code line is compared
  assert M.code_sim_score("```python\n# add them\nreturn a + b\n```", "return a + b") == 1.0
  assert M.code_sim_score("\n\n// set x\nint x = 1;", "int x = 1;") == 1.0
  # a line *containing* "#" (a trailing comment) is passed over as well
  assert M.code_sim_score("x = 1  # one\ny = 2", "y = 2") == 1.0
  # nothing but comments: the prediction is empty, ratio 0
  assert M.code_sim_score("# only\n// comments", "y = 2") == 0.0
  # fuzz ratio 33 -> 0.33
  assert M.code_sim_score("aba", "bca") == pytest.approx(0.33)


# --------------------------------------------------------------------------------------------
# Tables and dataset scores


def test_dataset_tables():
  assert len(M.LONGBENCH_DATASETS) == 21
  assert set(M.LONGBENCH_E_DATASETS) <= set(M.LONGBENCH_DATASETS)
  assert len(M.LONGBENCH_E_DATASETS) == 13
  sizes = {c: sum(v == c for v in M.DATASET_CATEGORY.values()) for c in M.CATEGORIES}
  assert sizes == {"Single-Doc QA": 4, "Multi-Doc QA": 4, "Summarization": 4,
                   "Few-shot Learning": 4, "Synthetic": 3, "Code": 2}
  assert M.DATASET_METRIC["dureader"] is M.rouge_zh_score
  assert M.DATASET_CATEGORY["dureader"] == "Multi-Doc QA"
  assert M.DATASET_METRIC["triviaqa"] is M.qa_f1_score
  assert M.DATASET_METRIC["lsht"] is M.classification_score
  assert M.DATASET_METRIC["passage_count"] is M.count_score
  assert M.DATASET_METRIC["repobench-p"] is M.code_sim_score
  assert sum(v == "zh" for v in M.DATASET_LANGUAGE.values()) == 5


def test_first_line_preprocessing():
  raw = "\n\nCity\nCountry is also possible"
  assert M.prepare_prediction("trec", raw) == "City"
  assert M.prepare_prediction("hotpotqa", raw) == raw
  # scored whole, the prediction names City and Country (1/2); trec scores the first line only
  assert M.classification_score(raw, "City", TREC_CLASSES) == 0.5
  assert M.score_longbench("trec", [raw], [["City"]], TREC_CLASSES) == 100.0
  # triviaqa: "Paris" alone (F1 1), not "Paris\nQuestion: what ..." (F1 < 1)
  assert M.score_longbench("triviaqa", ["Paris\nQuestion: what about Rome?"], [["Paris"]]) == 100.0


def test_score_longbench_max_over_answers_mean_and_rounding():
  preds = ["The Eiffel Tower in Paris", "no idea", "Paris"]
  answers = [["Paris, France", "Paris"], ["Paris"], ["Paris"]]
  # per sample: max(1/3, 0.4) = 0.4, 0, 1 -> mean 1.4/3 = 0.46667 -> 46.67
  assert M.score_longbench("hotpotqa", preds, answers) == 46.67


def test_score_longbench_e_buckets():
  preds = ["7", "3", "7", "1 2", "7 7 8"]
  answers = [["7"], ["7"], ["7"], ["2"], ["7"]]
  lengths = [10, 3999, 4000, 7999, 8000]
  # scores 1, 0 | 1, 1/2 | 2/3 -> 0-4k 50.0, 4-8k 75.0, 8k+ 66.67
  assert M.score_longbench_e("passage_count", preds, answers, lengths) == {
      "0-4k": 50.0, "4-8k": 75.0, "8k+": 66.67}
  out = M.score_longbench_e("passage_count", preds[:2], answers[:2], lengths[:2])
  assert out["0-4k"] == 50.0 and math.isnan(out["4-8k"]) and math.isnan(out["8k+"])


def test_bad_dataset_input():
  with pytest.raises(ElasticJaxError, match=r"unknown LongBench dataset 'hotpot_qa'.*narrativeqa"):
    M.score_longbench("hotpot_qa", ["x"], [["x"]])
  with pytest.raises(ElasticJaxError, match="unknown LongBench dataset"):
    M.score_longbench_e("nq", ["x"], [["x"]], [1])
  with pytest.raises(ElasticJaxError, match="all_classes"):
    M.score_longbench("lsht", ["x"], [["x"]])
  with pytest.raises(ElasticJaxError, match="differ in length"):
    M.score_longbench("qasper", ["x", "y"], [["x"]])
  with pytest.raises(ElasticJaxError, match="list of strings"):
    M.score_longbench("qasper", ["x"], ["x"])
  with pytest.raises(ElasticJaxError, match="no samples"):
    M.score_longbench("qasper", [], [])


# --------------------------------------------------------------------------------------------
# LongBench-v2


def test_extract_choice():
  assert M.extract_choice("The correct answer is (B)") == "B"
  assert M.extract_choice("Thus: The correct answer is C.") == "C"
  # markdown emphasis is removed first
  assert M.extract_choice("**The correct answer is (D)**") == "D"
  assert M.extract_choice("The correct answer is **A**") == "A"
  # the parenthesized form wins even when a bare one comes first
  assert M.extract_choice("The correct answer is A, no: The correct answer is (B)") == "B"
  assert M.extract_choice("I would pick B") is None
  assert M.extract_choice("the correct answer is (A)") is None
  assert M.extract_choice("The correct answer is (E)") is None


def _v2_record(answer, difficulty, length):
  return {"answer": answer, "difficulty": difficulty, "length": length}


def test_score_longbench_v2():
  records = [_v2_record("A", "easy", "short"), _v2_record("B", "easy", "medium"),
             _v2_record("C", "hard", "long"), _v2_record("D", "hard", "short"),
             _v2_record("A", "hard", "medium"), _v2_record("B", "hard", "long")]
  responses = ["The correct answer is (A)",       # right
               "The correct answer is C",         # wrong
               "**The correct answer is (C)**",   # right
               "I cannot tell",                   # no answer
               "The correct answer is A",         # right
               "The correct answer is (B)."]      # right
  # overall 4/6 = 66.67 -> 66.7; easy 1/2; hard 3/4; short 1/2; medium 1/2; long 2/2
  assert M.score_longbench_v2(records, responses) == {
      "overall": 66.7, "easy": 50.0, "hard": 75.0, "short": 50.0, "medium": 50.0,
      "long": 100.0}
  # compensated: the unanswered hard/short item counts 0.25. overall 4.25/6 = 70.83 -> 70.8;
  # hard 3.25/4 = 81.25 -> 81.2 (Python's round, half to even on the exact 81.25, as
  # published); short 1.25/2 = 62.5
  assert M.score_longbench_v2(records, responses, compensated=True) == {
      "overall": 70.8, "easy": 50.0, "hard": 81.2, "short": 62.5, "medium": 50.0,
      "long": 100.0}
  out = M.score_longbench_v2(records[:2], responses[:2])
  assert out["overall"] == 50.0 and math.isnan(out["hard"]) and math.isnan(out["long"])


def test_score_longbench_v2_bad_input():
  with pytest.raises(ElasticJaxError, match="2 records but 1 responses"):
    M.score_longbench_v2([_v2_record("A", "easy", "short")] * 2, ["x"])
  with pytest.raises(ElasticJaxError, match="record 0: difficulty 'Easy'"):
    M.score_longbench_v2([_v2_record("A", "Easy", "short")], ["x"])
  with pytest.raises(ElasticJaxError, match="record 0: answer 'a'"):
    M.score_longbench_v2([_v2_record("a", "easy", "short")], ["x"])


def test_report_intervals_paired_differences_and_routing_patterns():
  from types import SimpleNamespace
  import numpy as np
  from elastic_jax.eval.report import interval, markdown, paired_difference, summarize
  # Wilson's 95% interval for 5 of 10 (textbook value 0.2366-0.7634) and for 10 of 10.
  lo, hi = interval([100] * 5 + [0] * 5)
  assert abs(lo - 23.66) < 0.01 and abs(hi - 76.34) < 0.01
  lo, hi = interval([100] * 10)
  assert abs(lo - 72.25) < 0.01 and hi == pytest.approx(100.0)
  lo, hi = interval([10.0, 30.0, 50.0])           # not exact match: mean +- 1.96 sd / sqrt(n)
  assert (lo + hi) / 2 == pytest.approx(30.0) and hi - lo == pytest.approx(2 * 1.96 * 20 / 3 ** 0.5,
                                                                          rel=1e-3)
  # Exact match, paired: Bonett-Price adjusted Wald. 2 pairs a-not-b, 0 b-not-a, n = 4:
  # p12 = 3/6, p21 = 1/6, centre 1/3, se = sqrt((2/3 - 1/9) / 6) = 0.30429.
  d = paired_difference([100, 100, 100, 0], [0, 100, 0, 0])
  assert d["diff"] == 50.0 and d["ci95"] == pytest.approx(
      [100 * (1 / 3 - 1.96 * 0.30429), 100 * (1 / 3 + 1.96 * 0.30429)], rel=1e-3)
  same = paired_difference([100] * 200, [100] * 200)      # no discordant pair: not a point
  assert same["diff"] == 0 and same["ci95"][0] < -0.5 and same["ci95"][1] > 0.5
  assert paired_difference([100] * 5, [0] * 5)["ci95"][1] <= 100.0
  d = paired_difference([10.0, 30.0, 50.0, 20.0], [0.0, 30.0, 20.0, 20.0])   # not exact match
  assert d["diff"] == 10.0 and d["ci95"] == pytest.approx(
      [10 - 1.96 * np.std([10, 0, 30, 0], ddof=1) / 2, 10 + 1.96 * np.std([10, 0, 30, 0], ddof=1) / 2],
      rel=1e-3)
  items = [SimpleNamespace(key=f"k{i}", task="kv") for i in range(4)]
  gates = {0: [[1, 0], [0, 0]], 1: [[1, 0], [0, 0]], 2: [[0, 0], [0, 1]], 3: [[1, 1], [0, 0]]}
  records = {}
  for i, it in enumerate(items):
    base = {"msr": 0.5, "esr": 0.1, "prefill_seconds": 1.0, "cache_bytes": 1.0,
            "dense_cache_bytes": 2.0}
    records[("full", it.key)] = {**base, "prediction": "right", "msr": 0.0,
                                 "gates": [[1, 1], [1, 1]]}
    records[("elastic", it.key)] = {**base, "prediction": "right" if i < 2 else "wrong",
                                    "msr": [0.75, 0.75, 0.75, 0.5][i], "gates": gates[i]}
  score = lambda task, preds, its: 100.0 * sum(p == "right" for p in preds) / len(preds)
  summary = summarize(records, items, score, lambda t: "Single QA")
  out = summary["attention"]
  assert summary["item_scores"]["elastic"] == {"k0": 100.0, "k1": 100.0, "k2": 0.0, "k3": 0.0}
  el = out["elastic"]["tasks"]["kv"]
  assert el["score"] == 50.0 and el["patterns"] == 3 and out["full"]["tasks"]["kv"]["patterns"] == 1
  assert el["vs_full"]["diff"] == -50.0 and el["msr_sd"] == pytest.approx(np.std([.75] * 3 + [.5]))
  assert "vs_full" not in out["full"]["tasks"]["kv"]
  text = markdown({"attention": out}, "t")
  assert "| kv | elastic | 4 | 50.0 [15.0, 85.0] | -50.0 [" in text
