"""Training prompts from text that every Python install has: the standard library's docstrings.

Each documented function or class gives a few prompts (explain it, use it, summarise its docstring).
Debian's `fortunes` files, when installed, add prose prompts. The order is deterministic for a seed.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from collections.abc import Iterator
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
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            summary = _summary(doc)
            if 20 <= len(summary) <= 400:
                yield f"{module_name}.{name}", summary


def fortune_texts(limit: int = 3000) -> list[str]:
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


def training_prompts(count: int, seed: int = 0, exclude: set[str] | None = None) -> list[str]:
    """Up to `count` distinct prompts, shuffled by `seed`, none of them in `exclude`."""
    prompts = [t.format(qual=q, summary=s) for q, s in docstring_items() for t in TEMPLATES]
    prompts += [t.format(text=x) for x in fortune_texts() for t in PROSE_TEMPLATES[:1]]
    unique = sorted(set(prompts) - (exclude or set()))
    random.Random(seed).shuffle(unique)
    return unique[:count]
