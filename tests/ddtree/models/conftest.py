"""The real default pair, pulled and loaded once for the tests of this package."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.models.default import default_drafter
from ddtree.models.pair import load_models
from ddtree.models.pull import pull


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return pull(quiet=True)


@pytest.fixture(scope="session")
def pair(smollm2: Path) -> tuple[object, object, object]:
    """Target, drafter and tokenizer on CPU in float32."""
    return load_models(str(smollm2), str(default_drafter()), "cpu", "float32")
