"""Training prompts from text that installs here, and conversations made of them.

The sources: the standard library's docstrings (code), words from Debian's word list (`wamerican`,
/usr/share/dict/words), sayings from Debian's `fortunes`, and numbers (word problems). Sources that are not
installed are skipped. Everything is deterministic for a seed.

The first `FIRST` prompts are the first recipe's, unchanged: code, topics and prose mixed evenly, one
template per word or saying. After them come, round robin, the rest of that list and six further streams:
more about each function, two functions of one module, more about each word, two words together, rewriting
and summarising the sayings, and word problems. None repeats and none is in `exclude`.

A prompt file is JSON lines, each `{"prompt": TEXT}` (one user turn) or `{"messages": [TEXT, ...]}` (the user
turns of one conversation, each asked after the target's reply to the one before).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import warnings
from collections.abc import Iterator, Sequence
from itertools import pairwise, zip_longest
from pathlib import Path
from typing import Any

from ddtree.errors import UserError

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


FIRST = 32_000  # the first recipe's prompts, kept first and unchanged

MORE_CODE_TEMPLATES = (
    "List three common mistakes people make with `{qual}` in Python, and how to avoid each.",
    "Write step-by-step instructions for a beginner who wants to use `{qual}`.",
    "Write two unit tests for `{qual}` with Python's unittest module, and say what each one checks.",
    'Summarise this Python documentation in one sentence:\n"{summary}"',
    "Write a short dialogue in which a student asks a teacher how to use `{qual}`.",
    'Rewrite this description for someone new to programming, and add an example:\n"{summary}"',
)
CODE_PAIR_TEMPLATES = (  # two functions or classes of one module
    "Compare `{a}` and `{b}` in Python: what does each do, and when would you use one rather than the other?",
    "Write a short Python program that uses both `{a}` and `{b}`, then explain it line by line.",
    "Explain the difference between `{a}` and `{b}`, with one small example of each.",
)
MORE_TOPIC_TEMPLATES = (
    "List five ideas connected with {word}, one line each.",
    "Explain step by step how someone could learn more about {word}.",
    "Write a short story for children in which {word} saves the day.",
    "Write a short dialogue between a teacher and a student about {word}.",
    "Write a riddle whose answer is '{word}', then give the answer.",
    "Write a short news report in which {word} is the main subject.",
    "Give a simple definition of '{word}' and two example sentences.",
    "Write a limerick about {word}.",
    "Describe {word} to someone who has never heard of it.",
    "Write a to-do list for a day that is all about {word}.",
)
WORD_PAIR_TEMPLATES = (
    "Compare {a} and {b}: how are they alike, and how are they different?",
    "Write a short story that involves both {a} and {b}.",
    "Write a short dialogue in which two friends argue about whether {a} or {b} is better.",
    "Write a poem that mentions {a} and {b}.",
    "Explain in a short paragraph how {a} could be connected to {b}.",
    "Write a Python program with one class for {a} and one for {b}, and show how they work together.",
)
MORE_PROSE_TEMPLATES = (  # {text}: a saying; {word}: a word from the word list
    "Summarise this text in one sentence:\n{text}",
    "Rewrite this text in plain, formal English:\n{text}",
    "Rewrite this text so that a child could understand it:\n{text}",
    "Turn this text into a short dialogue between two people:\n{text}",
    "List the main ideas of this text as bullet points:\n{text}",
    "Do you agree with this? Explain why or why not.\n{text}",
    "Write a short story about {word} that ends with this line:\n{text}",
    "Write a Python program that prints this text with its lines numbered:\n{text}",
)
MATH_TEMPLATES = (  # {a} > {b} >= 2, 2 <= {c} <= 12, 10 <= {n} <= 9999
    "{name} has {a} {things} and gives {b} of them to a friend. How many {things} are left? Explain your reasoning.",
    "A box holds {c} {things}. How many boxes are needed for {a} {things}? Solve it step by step.",
    "{name} buys {c} {things} at {b} dollars each. How much does {name} pay in total? Show your work.",
    "A train travels {n} kilometres in {c} hours. What is its average speed? Explain step by step.",
    "{name} reads {b} pages a day. How many days does it take to read a book of {n} pages?",
    "What is {a} times {b}? Show how to work it out by hand.",
    "What is {n} divided by {c}, and what is the remainder? Explain the steps.",
    "Is {n} a prime number? Explain how you checked.",
    "Convert {n} to binary, and explain the method.",
    "The price of {things} went up from {b} to {a} dollars. By what percentage did it rise?",
    "A rectangle is {a} metres long and {b} metres wide. What are its area and its perimeter?",
    "Write a Python function that returns the sum of the first n whole numbers, and use it for n = {n}.",
)
NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kofi", "Lena", "Mateo")
THINGS = ("apples", "pencils", "books", "marbles", "cookies", "stickers", "oranges", "cards", "shells", "stamps")
FOLLOW_UPS = (  # second user turns: they fit any first turn
    "Can you make that shorter, in at most three sentences?",
    "Now explain it again for a ten-year-old.",
    "Give one more example, please.",
    "Turn your answer into a bulleted list.",
    "What is the weakest part of your answer, and how would you improve it?",
    "Rewrite your answer in a more formal tone.",
    "Give your answer a short title.",
    "Summarise what you said in one sentence.",
    "Turn that into a short dialogue between two people.",
    "What follow-up question would be worth asking about this? Answer it too.",
    "Thanks! Are there any common misconceptions about this?",
    "Can you write a short Python snippet related to your answer?",
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
    """Up to `limit` words of the word lists (all of them, sorted, when there are no more than `limit`)."""
    words: set[str] = set()
    for path in WORD_LISTS:
        try:
            lines = path.read_text(errors="ignore").split()
        except OSError:
            continue
        words.update(w for w in lines if w.isalpha() and w.islower() and 4 <= len(w) <= 12)
    return sorted(words)[:limit] if len(words) <= limit else random.Random(0).sample(sorted(words), limit)


def training_prompts(count: int, seed: int = 0, exclude: set[str] | None = None) -> list[str]:
    """Up to `count` distinct prompts, none in `exclude`, deterministic for `seed`: the first recipe's up to
    `FIRST`, then the rest of them and the further streams, round robin (120,000 and more where the word
    list is installed; the word problems alone can fill any count)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    exclude = exclude or set()
    code, words, sayings = list(docstring_items()), topic_words(limit=2**62), fortune_texts(limit=2**62)
    first = _first_prompts(code, topic_words(), sayings[:12000], seed, exclude)
    taken = first[: min(count, FIRST)]
    if len(taken) < count:
        streams = [iter(first[FIRST:]), *_more_streams(code, words, sayings, seed, count)]
        _round_robin(streams, taken, exclude | set(taken), count)
    return taken


def _first_prompts(
    code: list[tuple[str, str]], words: list[str], sayings: list[str], seed: int, exclude: set[str]
) -> list[str]:
    """The first recipe's prompts, all of them: the three kinds interleaved, shuffled by `seed`."""
    rng = random.Random(seed)
    pools = [
        [t.format(qual=q, summary=s) for q, s in code for t in TEMPLATES],
        [rng.choice(TOPIC_TEMPLATES).format(word=w) for w in words],
        [rng.choice(PROSE_TEMPLATES).format(text=x) for x in sayings],
    ]
    for pool in pools:
        pool[:] = sorted(set(pool) - exclude)
        rng.shuffle(pool)
    mixed: list[str] = []
    seen: set[str] = set()
    for group in zip_longest(*pools):
        for prompt in group:
            if prompt is not None and prompt not in seen:
                seen.add(prompt)
                mixed.append(prompt)
    return mixed


def _more_streams(
    code: list[tuple[str, str]], words: list[str], sayings: list[str], seed: int, count: int
) -> list[Iterator[str]]:
    """The further streams, each with its own random generator."""
    rng = [random.Random(f"prompts {seed} stream {k}") for k in range(6)]
    sayings_with_words = [{"text": x, "word": rng[4].choice(words) if words else "a stranger"} for x in sayings]
    return [
        _spread([{"qual": q, "summary": s} for q, s in code], MORE_CODE_TEMPLATES, rng[0]),
        _spread(_function_pairs(code, rng[1]), CODE_PAIR_TEMPLATES, rng[1]),
        _spread([{"word": w} for w in words], MORE_TOPIC_TEMPLATES, rng[2]),
        _spread(_word_pairs(words, rng[3]), WORD_PAIR_TEMPLATES, rng[3]),
        _spread(sayings_with_words, MORE_PROSE_TEMPLATES, rng[4]),
        _word_problems(rng[5], limit=4 * count),
    ]


def _spread(items: list[dict[str, str]], templates: Sequence[str], rng: random.Random) -> Iterator[str]:
    """Every (item, template) pair once, lazily: pass p gives every item (in a shuffled order) the p-th
    template after one drawn for it, so that each pass mixes the templates."""
    items = items[:]
    rng.shuffle(items)
    starts = [rng.randrange(len(templates)) for _ in items]
    for p in range(len(templates)):
        for item, start in zip(items, starts, strict=True):
            yield templates[(start + p) % len(templates)].format(**item)


def _function_pairs(code: list[tuple[str, str]], rng: random.Random) -> list[dict[str, str]]:
    """Neighbours in a shuffled order of each module's names."""
    modules: dict[str, list[str]] = {}
    for qual, _ in code:
        modules.setdefault(qual.rsplit(".", 1)[0], []).append(qual)
    pairs = []
    for names in modules.values():
        rng.shuffle(names)
        pairs += [{"a": a, "b": b} for a, b in pairwise(names)]
    return pairs


def _word_pairs(words: list[str], rng: random.Random) -> list[dict[str, str]]:
    """Neighbours in a shuffled order of the words."""
    order = words[:]
    rng.shuffle(order)
    return [{"a": a, "b": b} for a, b in pairwise(order)]


def _word_problems(rng: random.Random, limit: int) -> Iterator[str]:
    for _ in range(limit):
        a, b = sorted(rng.sample(range(2, 100), 2), reverse=True)
        names = {"name": rng.choice(NAMES), "things": rng.choice(THINGS)}
        numbers = {"a": a, "b": b, "c": rng.randint(2, 12), "n": rng.randint(10, 9999)}
        yield rng.choice(MATH_TEMPLATES).format(**names, **numbers)


def _round_robin(streams: list[Iterator[str]], taken: list[str], seen: set[str], count: int) -> None:
    """Append to `taken` the next prompt not in `seen` of each stream in turn, until `count` (or until every
    stream has run out)."""
    live = list(streams)
    while live:
        for stream in live[:]:
            prompt = next((p for p in stream if p not in seen), None)
            if prompt is None:
                live.remove(stream)
                continue
            seen.add(prompt)
            taken.append(prompt)
            if len(taken) >= count:
                return


def add_follow_ups(conversations: Sequence[Sequence[str]], fraction: float, seed: int = 0) -> list[list[str]]:
    """The conversations, with a second user turn from `FOLLOW_UPS` added to about `fraction` of the one-turn
    ones. The draw is made for each conversation in turn: a longer list starts with the same conversations."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"the multi-turn fraction must be between 0 and 1, got {fraction}")
    rng = random.Random(f"follow-ups {seed}")
    out = []
    for turns in conversations:
        draw, follow_up = rng.random(), rng.choice(FOLLOW_UPS)
        out.append([*turns, follow_up] if len(turns) == 1 and draw < fraction else list(turns))
    return out


def read_prompt_file(path: str | Path) -> list[list[str]]:
    """The conversations (lists of user turns) of a prompt file, in its order."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read prompts from {str(path)!r}: {exc}") from exc
    conversations = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conversations.append(_user_turns(json.loads(line)))
        except ValueError as exc:
            raise UserError(f"prompts {str(path)!r}, line {number}: {exc}") from exc
    return conversations


def _user_turns(record: Any) -> list[str]:
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ValueError(f'expected an object with "prompt" or "messages" (not both), got {str(record)[:80]!r}')
    turns = [record["prompt"]] if "prompt" in record else record["messages"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"user turns are non-empty strings, at least one, got {str(turns)[:80]!r}")
    return turns


def write_prompt_file(path: str | Path, conversations: Sequence[Sequence[str]]) -> None:
    """Write conversations as `read_prompt_file` reads them: one turn as "prompt", more as "messages"."""
    with Path(path).open("w") as f:
        for turns in conversations:
            record = {"prompt": turns[0]} if len(turns) == 1 else {"messages": list(turns)}
            f.write(json.dumps(record) + "\n")
