"""Every span, stage and attribute name in one place. Dashboards and tests import these."""

from __future__ import annotations

from typing import Final

STAGE_DRAFT: Final = "draft"
STAGE_TREE_BUILD: Final = "tree_build"
STAGE_VERIFY: Final = "verify"
STAGE_ACCEPT: Final = "accept"
STAGES: Final = (STAGE_DRAFT, STAGE_TREE_BUILD, STAGE_VERIFY, STAGE_ACCEPT)

SPAN_STEP: Final = "ddtree.step"
SPAN_PREFIX: Final = "ddtree."


def stage_span_name(stage: str) -> str:
    """`draft` -> `ddtree.draft`."""
    return SPAN_PREFIX + stage
