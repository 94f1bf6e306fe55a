"""Training prompts from text that installs here, in three kinds, mixed evenly:

- code: the standard library's docstrings (explain a function, use it, write one like it);
- topics: words from Debian's word list (`wamerican`, /usr/share/dict/words) in everyday requests;
- prose: sayings from Debian's `fortunes`.

Sources that are not installed are skipped. The order is deterministic for a seed.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path

STDLIB_MODULES = (  # noqa: SIM905
    "abc argparse array ast asyncio base64 bisect calendar cmath collections colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib email enum filecmp fnmatch fractions "
    "ftplib functools getopt gettext glob graphlib gzip hashlib heapq hmac html http imaplib inspect io "
    "ipaddress itertools json keyword linecache locale logging lzma mailbox math mimetypes operator os "
    "pathlib pickle pkgutil platform plistlib poplib pprint profile pstats queue quopri random re "
    "reprlib sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl "
    "stat statistics string struct subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap "
    "threading time timeit token tokenize tomllib trace traceback tracemalloc types typing unicodedata "
    "unittest urllib uuid warnings wave weakref xml zipfile zipimport zlib zoneinfo"
).split()

FORTUNE_DIRS = (Path("/usr/share/games/fortunes"), Path("/usr/share/fortunes"))
WORD_LISTS = (Path("/usr/share/dict/words"),)

TEMPLATES = (
    "Explain what `{qual}` does in Python, and show a short example.",
    "Write a small Python program that uses `{qual}`.",
    'Here is the documentation of `{qual}`:\n"{summary}"\nExplain it in simple words.',
    "When would a Python developer use `{qual}`? Give one practical case.",
    "Write a Python function, with a docstring, that does this: {summary}",
)
PROSE_TEMPLATES = (
    "What does this saying mean? {text}",
    "Write a short story that ends with: {text}",
    "Explain the joke or the idea: {text}",
)
TOPIC_TEMPLATES = (
    "Write a short poem about {word}.",
    "What is the meaning of the word '{word}'? Use it in two sentences.",
    "Write a short story in which {word} plays an important part.",
    "Give three interesting facts related to {word}.",
    "Explain {word} to a ten-year-old.",
    "Write a short paragraph describing {word}.",
    "Write a Python function whose job has something to do with {word}, and explain it.",
    "What questions would you ask an expert on {word}? List three.",
    "Write a haiku about {word}.",
    "Write a friendly email to a friend about {word}.",
    "Why does {word} matter? Answer in a short paragraph.",
    "How does {word} work? Explain briefly.",
    "Write step-by-step instructions for a simple task involving {word}.",
    "Write a short product description for something called {word}.",
    "Write a short dialogue between two friends about {word}.",
    "Write a Python class that models {word}, with one method and a usage example.",
)


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", first).strip()


def docstring_items() -> Iterator[tuple[str, str]]:
    """(qualified name, first paragraph) for public documented callables of the stdlib modules above."""
    for module_name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # some modules warn on attribute access
                doc = inspect.getdoc(obj)
            if not doc:
                continue
            summary = _summary(doc)
            if 20 <= len(summary) <= 400:
                yield f"{module_name}.{name}", summary


def fortune_texts(limit: int = 12000) -> list[str]:
    texts: list[str] = []
    for directory in FORTUNE_DIRS:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix or not path.is_file():
                continue
            try:
                chunks = path.read_text(errors="ignore").split("\n%\n")
            except OSError:
                continue
            texts.extend(c.strip() for c in chunks if 30 <= len(c.strip()) <= 300)
    return texts[:limit]


def topic_words(limit: int = 40000) -> list[str]:
    words: set[str] = set()
    for path in WORD_LISTS:
        try:
            lines = path.read_text(errors="ignore").split()
        except OSError:
            continue
        words.update(w for w in lines if w.isalpha() and w.islower() and 4 <= len(w) <= 12)
    return sorted(words)[:limit] if len(words) <= limit else random.Random(0).sample(sorted(words), limit)


def training_prompts(count: int, seed: int = 0, exclude: set[str] | None = None) -> list[str]:
    """Up to `count` distinct prompts, the kinds interleaved, shuffled by `seed`, none in `exclude`."""
    rng = random.Random(seed)
    code = [t.format(qual=q, summary=s) for q, s in docstring_items() for t in TEMPLATES]
    topics = [rng.choice(TOPIC_TEMPLATES).format(word=w) for w in topic_words()]
    prose = [rng.choice(PROSE_TEMPLATES).format(text=x) for x in fortune_texts()]
    pools = []
    for pool in (code, topics, prose):
        unique = sorted(set(pool) - (exclude or set()))
        rng.shuffle(unique)
        pools.append(unique)
    mixed: list[str] = []
    seen: set[str] = set()
    for group in zip_longest(*pools):
        for prompt in group:
            if prompt is not None and prompt not in seen:
                seen.add(prompt)
                mixed.append(prompt)
    return mixed[:count]
