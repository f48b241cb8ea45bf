"""The RULER task generator (elastic_jax.eval.ruler): lengths, contents, determinism, scoring.

Every check that a sample is right reads the prompt text back independently: needles and
questions by regular expression, variable chains by resolving the assignments, word
frequencies by counting. A small byte-level BPE built here stands in for a real tokenizer.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_jax.errors import ElasticJaxError
from elastic_jax.eval import ruler

NIAH = [t for t, spec in ruler.TASKS.items() if spec.family == "niah"]
LENGTHS = (1024, 4096)
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE = re.compile(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from toktools import make_tokenizer
  from transformers import AutoTokenizer
  data = Path(ruler.__file__).parent / "ruler_data"
  texts = [(data / name).read_text() for name in sorted(os.listdir(data))]
  texts += ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back"
            " again.", "One of the special magic numbers for brave-scissors is: 1234567.",
            "VAR ABCDE = VAR FGHIJ 0123456789 9f86d081-884c-4d63-a5f0-0f2bcd0a1b23",
            " ".join(f"{i}. item" for i in range(1, 1000))]   # numbers as whole tokens
  return AutoTokenizer.from_pretrained(make_tokenizer(tmp_path_factory.mktemp("ruler_tok"),
                                                      texts, vocab_size=2000))


@pytest.fixture(scope="module")
def gen(tok):
  """gen(task, length, num=2, seed=0): cached samples, so checks share one generation."""
  @functools.lru_cache(maxsize=None)
  def make(task, length, num=2, seed=0):
    return tuple(ruler.generate(task, tok, length, num, seed=seed))
  return make


def count(tok, text):
  return len(tok(text, add_special_tokens=False)["input_ids"])


def test_task_table():
  assert set(ruler.TASKS) == {
      "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
      "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"}
  budgets = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
             "freq_words_extraction": 50}
  for spec in ruler.TASKS.values():
    assert spec.max_new_tokens == budgets[spec.family]
    assert spec.metric == "all"


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_length_within_two_percent(tok, gen, task, length):
  samples = gen(task, length)
  assert [s.index for s in samples] == [0, 1]
  for s in samples:
    assert s.task == task and s.max_new_tokens == ruler.TASKS[task].max_new_tokens
    assert s.length == count(tok, s.input + s.answer_prefix) + s.max_new_tokens
    assert 0.98 * length <= s.length <= length, (s.length, length)
    assert s.outputs and all(isinstance(o, str) and o for o in s.outputs)


def _question_keys(text):
  m = re.search(r"What (?:is|are all) the special magic \w+ for (.+) mentioned in the provided"
                r" text\?$", text)
  assert m, text[-300:]
  return re.split(r", and |, ", m.group(1))


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", NIAH)
def test_niah_needles_and_question(gen, task, length):
  spec = ruler.TASKS[task]
  for s in gen(task, length):
    head, _, rest = s.input.partition("\n")
    context, _, question = rest.rpartition("\n")
    needles = NEEDLE.findall(context)
    by_key = collections.defaultdict(list)
    for kinds, key, value in needles:
      assert kinds == spec.needle_v
      by_key[key].append(value)
    asked = _question_keys(question)
    assert len(asked) == spec.num_needle_q == len(set(asked))
    prefix_query = re.fullmatch(r" The special magic \w+ for (.+) mentioned in the provided"
                                r" text (?:is|are)", s.answer_prefix)
    assert prefix_query and prefix_query.group(1) == re.search(r" for (.+) mentioned",
                                                               question).group(1)
    # The references are exactly the values the text binds to the asked keys.
    assert sorted(s.outputs) == sorted(v for k in asked for v in by_key[k])
    assert len(s.outputs) == spec.num_needle_q * spec.num_needle_v
    for key in asked:
      assert len(by_key[key]) == spec.num_needle_v
    # Every key and value in the text is unique, so no distractor shadows an answer.
    values = [v for _, _, v in needles]
    assert len(values) == len(set(values)) and not set(values) & set(by_key)
    key_re = UUID if spec.needle_k == "uuids" else r"[a-z]+-[a-z]+"
    value_re = UUID if spec.needle_v == "uuids" else r"[1-9]\d{6}"
    assert all(re.fullmatch(key_re, k) for k in by_key)
    assert all(re.fullmatch(value_re, v) for v in values)
    # Wording: singular when one value is asked for, as RULER.
    if len(s.outputs) == 1:
      kind = spec.needle_v[:-1]
      assert head == (f"A special magic {kind} is hidden within the following text. Make sure"
                      f" to memorize it. I will quiz you about the {kind} afterwards.")
      assert s.answer_prefix.endswith(" text is")
    else:
      assert head.startswith(f"Some special magic {spec.needle_v} are hidden")
      assert s.answer_prefix.endswith(" text are")
    # Haystack kinds and distractors.
    noise = "The grass is green. The sky is blue."
    if spec.haystack == "noise":
      assert context.count(noise) > 5
    elif spec.haystack == "essay":
      assert noise not in context and context.count(". ") > 20
    if spec.haystack == "needle":
      assert len(by_key) >= length // 200   # distractor needle lines, each with its own key
    else:
      assert len(by_key) == max(spec.num_needle_k, spec.num_needle_q)
    if task == "niah_multikey_1":
      assert len(set(by_key) - set(asked)) == 3


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2"])
def test_niah_depths_spread(gen, task):
  depths = []
  for s in gen(task, 2048, 16):
    context = s.input.partition("\n")[2].rpartition("\n")[0]
    m = NEEDLE.search(context)
    depths.append(m.start() / len(context))
  assert min(depths) < 0.25 and max(depths) > 0.75
  assert len({round(d, 2) for d in depths}) >= 10


def _resolve(text):
  """Variable -> value for every `VAR X = value` / `VAR X = VAR Y` line of `text`."""
  direct, alias = {}, {}
  for name, number, source in re.findall(r"^VAR (\w+) = (?:(\d+)|VAR (\w+))$", text, re.M):
    if number:
      direct[name] = number
    else:
      alias[name] = source
  out = {}
  for name in list(direct) + list(alias):
    seen, cur = set(), name
    while cur in alias and cur not in seen:
      seen.add(cur)
      cur = alias[cur]
    if cur in direct:
      out[name] = direct[cur]
  return out


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_chain(gen, length):
  for s in gen("vt", length):
    cut = s.input.rindex("Memorize and track")
    demo, task = s.input[:cut], s.input[cut:]
    query = re.search(r"assigned the value (\d+) in the text above\.$", task).group(1)
    assert re.fullmatch(rf" Answer: According to the chain\(s\) of variable assignment in the"
                        rf" text above, 5 variables are assigned the value {query}, they are: ",
                        s.answer_prefix)
    values = _resolve(task)
    assert len(values) == 5
    assert sorted(s.outputs) == sorted(v for v, x in values.items() if x == query)
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in s.outputs)
    # The solved example: 3-letter names, and its stated answer is its own chain.
    demo_values = _resolve(demo)
    demo_query = re.search(r"assigned the value (\d+), they are: ([A-Z ]+)\n\n$", demo)
    assert demo_query, demo[-200:]
    listed = demo_query.group(2).split()
    assert len(listed) == 5 and all(len(v) == 3 for v in listed)
    assert sorted(listed) == sorted(v for v, x in demo_values.items()
                                    if x == demo_query.group(1))


def _numbered(listing):
  items = re.findall(r"(\d+)\. (\S+)", listing)
  assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
  return [w for _, w in items]


def _strict_top(counter, chosen):
  """True when every chosen word is strictly more frequent than every other word."""
  others = [c for w, c in counter.items() if w not in chosen]
  return min(counter[w] for w in chosen) > max(others, default=0)


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_most_common(gen, length):
  for s in gen("cwe", length):
    cut = s.input.rindex("Below is a numbered list of words.")
    task = s.input[cut:]
    listing = task.partition("\n")[2].rpartition("\nQuestion:")[0]
    counts = collections.Counter(_numbered(listing))
    assert len(s.outputs) == len(set(s.outputs)) == 10
    assert _strict_top(counts, set(s.outputs))
    common, rare = (6, 1) if length < 4096 else (30, 3)   # RULER's repeats per length
    assert {counts[w] for w in s.outputs} == {common}
    assert set(counts.values()) == {common, rare}
    assert task.endswith("Question: What are the 10 most common words in the above list?")
    # The solved example lists its own most common words, and shares none with the task.
    demo = s.input[:cut]
    demo_listing, _, demo_answer = demo.partition("\nQuestion:")
    demo_counts = collections.Counter(_numbered(demo_listing.partition("\n")[2]))
    stated = _numbered(demo_answer.partition("are:")[2])
    assert len(stated) == 10 and _strict_top(demo_counts, set(stated))
    assert not set(demo_counts) & set(counts)


def test_cwe_beyond_the_word_lists():
  """Lists longer than the shipped vocabulary are extended by distinct pseudo-words."""
  builder = ruler._CommonWords(ruler.TASKS["cwe"], {"short": False}, "t")
  n = len(ruler._words()["all"]) + 500
  text, _, outputs = builder.build(n)
  listing = text[text.rindex("Below is"):].partition("\n")[2].rpartition("\nQuestion:")[0]
  counts = collections.Counter(_numbered(listing))
  assert len(counts) == n and _strict_top(counts, set(outputs))


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_most_frequent(gen, length):
  for s in gen("fwe", length):
    context = re.search(r"coded words\. (.*)\nQuestion:", s.input, re.S).group(1)
    words = context.split(" ")
    counts = collections.Counter(words)
    assert counts.most_common(1)[0][0] == "..."
    del counts["..."]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)
    assert len(s.outputs) == 3 and _strict_top(counts, set(s.outputs))
    assert len(counts) <= (length - 50) // 50 - 1


def test_deterministic(tok, gen):
  for task in ("niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"):
    first = gen(task, 1024)
    again = ruler.generate(task, tok, 1024, 2, seed=0)
    assert list(first) == again
    other = gen(task, 1024, seed=1)
    assert all(a.input != b.input for a, b in zip(first, other))
    assert first[0].input != first[1].input


def test_deterministic_across_processes(tok, gen, tmp_path):
  """Nothing depends on hash order: a fresh interpreter with another hash seed agrees."""
  tok.save_pretrained(tmp_path)
  code = ("import sys; from transformers import AutoTokenizer; from elastic_jax.eval import ruler;"
          "t = AutoTokenizer.from_pretrained(sys.argv[1]);"
          "print(repr([s.input + s.answer_prefix for task in ('niah_multiquery', 'cwe', 'vt')"
          " for s in ruler.generate(task, t, 1024, 2)]))")
  env = dict(os.environ, PYTHONHASHSEED="12345")
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, env=env, check=True).stdout.strip().splitlines()[-1]
  here = [s.input + s.answer_prefix for task in ("niah_multiquery", "cwe", "vt")
          for s in gen(task, 1024)]
  assert out == repr(here)


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_too_small_length(tok, task):
  with pytest.raises(ElasticJaxError, match="at least"):
    ruler.generate(task, tok, 200, 1)


def test_stated_minimum_length_works(tok):
  with pytest.raises(ElasticJaxError) as err:
    ruler.generate("niah_multikey_1", tok, 150, 1)
  need = int(re.search(r"at least (\d+) tokens", str(err.value)).group(1))
  with pytest.raises(ElasticJaxError):
    ruler.generate("niah_multikey_1", tok, need - 1, 1)
  (s,) = ruler.generate("niah_multikey_1", tok, need, 1)
  assert s.length == need and len(NEEDLE.findall(s.input)) == 4


def test_bad_arguments(tok):
  with pytest.raises(ElasticJaxError, match="niah_single_1.*fwe"):
    ruler.generate("qa_1", tok, 4096, 1)
  with pytest.raises(ElasticJaxError, match="unknown RULER task"):
    ruler.score("nope", ["x"], [])
  with pytest.raises(ElasticJaxError, match="length"):
    ruler.generate("vt", tok, 0, 1)
  with pytest.raises(ElasticJaxError, match="num_samples"):
    ruler.generate("vt", tok, 4096, -1)
  assert ruler.generate("vt", tok, 4096, 0) == []


def test_string_match_hand_cases():
  assert ruler.string_match_all(["The numbers are 123 and 456."], [["123", "456"]]) == 100.0
  assert ruler.string_match_all(["only 123"], [["123", "456"]]) == 50.0
  assert ruler.string_match_part(["only 123"], [["123", "456"]]) == 100.0
  assert ruler.string_match_part(["nothing"], [["123", "456"]]) == 0.0
  assert ruler.string_match_all(["ABC def"], [["abc", "DEF"]]) == 100.0   # case-insensitive
  assert ruler.string_match_all(["a"], [["a", "b", "c"]]) == 33.33         # rounded percent
  assert ruler.string_match_all(["a b", "x"], [["A", "B"], ["y"]]) == 50.0  # mean over samples
  assert ruler.string_match_part(["a", "y z"], [["a", "q"], ["q", "z"]]) == 100.0
  assert ruler.string_match_part(["a", "z"], [["a"], ["b"], ]) == 50.0
  with pytest.raises(ElasticJaxError):
    ruler.string_match_all(["a"], [["a"], ["b"]])
  with pytest.raises(ElasticJaxError):
    ruler.string_match_all([], [])


def test_score(gen):
  samples = gen("niah_multivalue", 1024)
  full = [" " + ", ".join(s.outputs) + "." for s in samples]
  half = [" " + s.outputs[0] + " " + s.outputs[1].upper() for s in samples]
  assert ruler.score("niah_multivalue", full, list(samples)) == 100.0
  assert ruler.score("niah_multivalue", half, list(samples)) == 50.0
  # RULER's post-processing turns control characters into newlines before matching.
  (s,) = gen("vt", 1024, 1)
  fake = ruler.Sample("vt", 0, "", "", ["A\nB"], 0, 30)
  assert ruler.score("vt", ["  A\tB \x00"], [fake]) == 100.0
  assert ruler.score("vt", [" ".join(s.outputs[:4])], [s]) == 80.0
  with pytest.raises(ElasticJaxError):
    ruler.score("vt", ["x"], list(samples)[:1])
  with pytest.raises(ElasticJaxError):
    ruler.score("vt", ["x", "y"], [s])
