"""The synthetic sample corpus: parquet files in FineWeb-Edu's schema, generated offline.

FineWeb-Edu's columns are text, id, dump, url, file_path, language, language_score, token_count,
score and int_score, in files with row groups of about 1,000 rows; the sample keeps that schema and
layout so that every reader of the real corpus reads the sample unchanged. The text is templated
English lesson prose over a vocabulary of a few dozen words with a repeated structure (a title line,
then sentences built from a dozen templates), so a tiny byte-level model visibly learns it within a
hundred steps. Everything is a pure function of the seed: the same seed gives byte-identical files.
"""

from __future__ import annotations

import os
import random
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("text", pa.string()),
    ("id", pa.string()),
    ("dump", pa.string()),
    ("url", pa.string()),
    ("file_path", pa.string()),
    ("language", pa.string()),
    ("language_score", pa.float64()),
    ("token_count", pa.int64()),
    ("score", pa.float64()),
    ("int_score", pa.int64()),
])
"""FineWeb-Edu's parquet schema."""

ROW_GROUP_ROWS = 1000
"""Rows per row group, as in FineWeb-Edu's files."""

DUMPS = ("CC-MAIN-2013-20", "CC-MAIN-2017-04", "CC-MAIN-2019-35", "CC-MAIN-2021-43", "CC-MAIN-2024-10")

TOPICS = {
    "water": ("the river", "the rain", "the cloud", "the sea", "the ice"),
    "plants": ("the seed", "the leaf", "the root", "the flower", "the tree"),
    "animals": ("the bird", "the fish", "the horse", "the bee", "the fox"),
    "planets": ("the sun", "the moon", "the earth", "the star", "the comet"),
    "numbers": ("the sum", "the number", "the fraction", "the angle", "the line"),
    "weather": ("the wind", "the storm", "the snow", "the heat", "the air"),
}
VERBS = ("moves", "grows", "changes", "falls", "rises", "turns", "feeds", "warms")
ADJECTIVES = ("small", "large", "bright", "cold", "warm", "green", "slow", "quick")
PLACES = ("in the spring", "at night", "in the valley", "near the school", "after the rain", "every day")
TEMPLATES = (
    "{A} {verb} {place}.",
    "{A} is {adj} and {b} is {adj2}.",
    "When {a} {verb}, {b} {verb2}.",
    "Students learn that {a} {verb} {place}.",
    "The teacher says that {a} is {adj}.",
    "We can see that {a} {verb} when {b} is {adj}.",
    "First {a} {verb}, then {b} {verb2}.",
    "A {adj} day means that {a} {verb} {place}.",
    "Why is {a} {adj}? Because {b} {verb}.",
    "In this lesson we study how {a} {verb}.",
    "{A} and {b} are {adj} {place}.",
    "Remember: {a} {verb} and {b} {verb2}.",
)


@dataclass(frozen=True)
class SampleFile:
    path: str
    rows: int
    bytes: int


# random.Random(str) seeds through SHA-512 and random() is the same Mersenne Twister stream on every
# platform and Python version, so only these two primitives are used (not choice/sample, whose
# algorithms have changed between versions).
def _pick(rng: random.Random, items: tuple[str, ...]) -> str:
    return items[int(rng.random() * len(items))]


def _int(rng: random.Random, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi)."""
    return lo + int(rng.random() * (hi - lo))


def _sentence(rng: random.Random, nouns: tuple[str, ...]) -> str:
    i = _int(rng, 0, len(nouns))
    a, b = nouns[i], nouns[(i + _int(rng, 1, len(nouns))) % len(nouns)]
    s = _pick(rng, TEMPLATES).format(
        a=a, b=b, A=a.capitalize(), verb=_pick(rng, VERBS), verb2=_pick(rng, VERBS),
        adj=_pick(rng, ADJECTIVES), adj2=_pick(rng, ADJECTIVES), place=_pick(rng, PLACES))
    return s


def document(rng: random.Random, number: int) -> tuple[str, str]:
    """One lesson: (topic, text). A title line, then 1-3 paragraphs of 2-5 sentences."""
    topic = _pick(rng, tuple(TOPICS))
    nouns = TOPICS[topic]
    paragraphs = [" ".join(_sentence(rng, nouns) for _ in range(_int(rng, 2, 6)))
                  for _ in range(_int(rng, 1, 4))]
    return topic, f"Lesson {number}: {topic.capitalize()}.\n" + "\n".join(paragraphs)


def _table(seed: int, file_index: int, rows: int) -> pa.Table:
    rng = random.Random(f"agoractl-sample-{seed}-{file_index}")
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for r in range(rows):
        topic, text = document(rng, _int(rng, 1, 1000))
        dump = _pick(rng, DUMPS)
        score = round(2.5 + 2.5 * rng.random(), 6)
        cols["text"].append(text)
        cols["id"].append(f"<urn:uuid:{uuid.UUID(int=rng.getrandbits(128), version=4)}>")
        cols["dump"].append(dump)
        cols["url"].append(f"https://lessons.example.edu/{topic}/{file_index:03d}-{r:06d}.html")
        cols["file_path"].append(f"s3://commoncrawl/crawl-data/{dump}/segments/sample/warc/"
                                 f"{dump}-{file_index:05d}.warc.gz")
        cols["language"].append("en")
        cols["language_score"].append(round(0.9 + 0.1 * rng.random(), 6))
        # FineWeb-Edu's token_count is the GPT-2 count; a word-and-punctuation count stands in for it.
        cols["token_count"].append(len(text.split()) + text.count(".") + text.count(","))
        cols["score"].append(score)
        cols["int_score"].append(int(round(score)))
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def write_sample(out: str, rows: int = 8000, files: int = 4, seed: int = 0) -> list[SampleFile]:
    """Write `rows` documents over `files` parquet files into directory `out`; returns what was written.

    Files are named like FineWeb-Edu's (``000_00000.parquet``) and written to a temporary name, then
    renamed, so an interrupted run never leaves a truncated file under a final name.
    """
    os.makedirs(out, exist_ok=True)
    written = []
    base, extra = divmod(rows, files)
    for k in range(files):
        n = base + (1 if k < extra else 0)
        path = os.path.join(out, f"{k:03d}_00000.parquet")
        tmp = os.path.join(out, f".{k:03d}_00000.parquet.tmp")
        pq.write_table(_table(seed, k, n), tmp, row_group_size=ROW_GROUP_ROWS, compression="snappy")
        os.replace(tmp, path)
        written.append(SampleFile(path, n, os.path.getsize(path)))
    return written
