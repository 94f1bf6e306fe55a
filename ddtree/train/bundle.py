"""Bundles: tensors as safetensors shards of bounded size plus a JSON manifest, made to travel in parts.

A bundle named `state` in a directory is `state.json` (the manifest: every shard's name, size and sha256, and
the bundle's own metadata) and `state-00001-of-00005.safetensors`, ... Names use only `[A-Za-z0-9._-]`.

Parts split the files of one or more bundles into groups of at most `max_files` files and `max_bytes`
bytes, each group carrying the manifest of every bundle it holds a shard of, so that a part can be copied
on its own (`copy_part`) and the parts gathered back in any order (`gather`). A bundle is complete when all
the shards its manifest lists are present with the listed sha256.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from ddtree.models.pull import sha256_file

FORMAT = "ddtree-bundle"
VERSION = 1
MIB = 2**20
SHARD_BYTES = 15 * MIB  # the most one shard file may hold
HEADER_ROOM = 64 * 1024  # bytes kept free in a shard for its safetensors header (a quarter of small shards)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class BundleFile:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    directory: Path
    name: str
    files: tuple[BundleFile, ...]
    meta: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.json"

    def missing(self) -> list[str]:
        """The listed shards that are absent from the directory or differ from the listing."""
        return [f.name for f in self.files if not _matches(self.directory / f.name, f)]

    def content(self) -> dict[str, Any]:
        files = [{"name": f.name, "bytes": f.bytes, "sha256": f.sha256} for f in self.files]
        return {"format": FORMAT, "version": VERSION, "name": self.name, "files": files, "meta": self.meta}


def tensor_budget(shard_bytes: int) -> int:
    """The tensor bytes a shard of at most `shard_bytes` may hold, its header aside."""
    return max(1, shard_bytes - min(HEADER_ROOM, shard_bytes // 4))


def split_tensors(tensors: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> list[dict[str, torch.Tensor]]:
    """Group tensors (in key order) into shards of at most `shard_bytes` each, with huggingface_hub's splitter."""
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=tensor_budget(shard_bytes))
    return [{key: tensors[key] for key in keys} for keys in split.filename_to_tensors.values()]


def save_bundle(
    directory: Path, name: str, shards: Sequence[dict[str, torch.Tensor]], meta: dict[str, Any], shard_bytes: int
) -> Manifest:
    """Write `shards` as `<name>-NNNNN-of-NNNNN.safetensors` and then `<name>.json`, replacing any earlier
    bundle of that name in `directory`. Raises ValueError if a shard file comes out over `shard_bytes`."""
    _check_name(name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").unlink(missing_ok=True)  # no manifest names a half-written bundle
    for old in directory.glob(f"{name}-*-of-*.safetensors"):
        old.unlink()
    files = []
    for index, shard in enumerate(shards, start=1):
        path = directory / f"{name}-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in shard.items()}, str(path))
        size = path.stat().st_size
        if size > shard_bytes:
            raise ValueError(f"shard {path.name} holds {size} bytes, over the limit of {shard_bytes} bytes")
        files.append(BundleFile(path.name, size, sha256_file(path)))
    manifest = Manifest(directory, name, tuple(files), meta)
    tmp = manifest.path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.content(), indent=1) + "\n")
    tmp.replace(manifest.path)
    return manifest


def read_manifest(path: Path) -> Manifest:
    """Parse `<name>.json`; ValueError if it is not a bundle manifest or names unsafe files."""
    if not path.is_file():
        raise ValueError(f"no bundle manifest {path.name!r} in {str(path.parent)!r}")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
        files = tuple(BundleFile(str(f["name"]), int(f["bytes"]), str(f["sha256"])) for f in raw["files"])
        manifest = Manifest(path.parent, str(raw["name"]), files, dict(raw["meta"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{str(path)!r} is not a {FORMAT} manifest (version {VERSION}): {exc}") from exc
    for name in [manifest.name, *(f.name for f in files)]:
        _check_name(name)
    return manifest


def find_manifests(directory: Path) -> list[Manifest]:
    """Every bundle manifest among the JSON files of `directory`, by name."""
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            found.append(read_manifest(path))
        except ValueError:
            continue  # another JSON file
    return found


def load_bundle(directory: Path, name: str) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
    """The shards (in order) and metadata of a complete bundle; ValueError naming what is missing."""
    manifest = read_manifest(directory / f"{name}.json")
    missing = manifest.missing()
    if missing:
        have = len(manifest.files) - len(missing)
        raise ValueError(
            f"bundle {name!r} in {str(directory)!r} is incomplete: {have} of {len(manifest.files)} shards; "
            f"missing or corrupt: {', '.join(missing)}"
        )
    return [load_file(str(directory / f.name)) for f in manifest.files], manifest.meta


def plan_parts(manifests: Sequence[Manifest], max_files: int, max_bytes: int) -> list[list[Path]]:
    """Split the bundles' shards, in order, into parts within the limits; each part also holds the manifest
    of every bundle it has a shard of. ValueError if one shard and its manifest alone exceed a limit."""
    names = [m.name for m in manifests]
    if len(set(names)) != len(names):
        raise ValueError(f"bundles must have distinct names to travel together, got {names}")
    parts: list[list[Path]] = []
    current: list[Path] = []
    for manifest in manifests:
        for shard in manifest.files:
            extra = ([] if manifest.path in current else [manifest.path]) + [manifest.directory / shard.name]
            if current and not _fits(current + extra, max_files, max_bytes):
                parts.append(current)
                current = [manifest.path, manifest.directory / shard.name]
            else:
                current += extra
            if not _fits(current, max_files, max_bytes):
                raise ValueError(
                    f"{shard.name} ({shard.bytes} bytes) with its manifest does not fit a part of "
                    f"{max_files} files and {max_bytes} bytes"
                )
    return [*parts, current] if current else parts


def copy_part(sources: Sequence[Path], dest: Path, part: int, max_files: int, max_bytes: int) -> tuple[list[str], int]:
    """Copy part `part` (from 1) of the bundles in `sources` into `dest`; returns its file names and the
    number of parts."""
    manifests = [m for source in sources for m in _bundles_in(source)]
    parts = plan_parts(manifests, max_files, max_bytes)
    if not 1 <= part <= len(parts):
        raise ValueError(f"part {part} asked for, but there are {len(parts)} parts (1..{len(parts)})")
    dest.mkdir(parents=True, exist_ok=True)
    for path in parts[part - 1]:
        shutil.copyfile(path, dest / path.name)
    return [p.name for p in parts[part - 1]], len(parts)


def gather(source: Path, root: Path) -> dict[str, list[str]]:
    """Copy the verified shards of every bundle in `source` into `root/<name>/`; returns, per bundle, the
    shards still missing there. ValueError if a shard is corrupt or `root/<name>` holds another bundle."""
    missing = {}
    for manifest in _bundles_in(source):
        target = root / manifest.name
        here = target / manifest.path.name
        if here.is_file() and read_manifest(here).content() != manifest.content():
            raise ValueError(
                f"{str(target)!r} holds another {manifest.name!r} bundle than {str(source)!r} (their manifests "
                "differ): remove it, or gather the parts of the same export"
            )
        target.mkdir(parents=True, exist_ok=True)
        for shard in manifest.files:
            path = source / shard.name
            if not path.is_file() or _matches(target / shard.name, shard):
                continue
            if not _matches(path, shard):
                raise ValueError(f"{str(path)!r} does not match its manifest (size or sha256): a damaged copy")
            shutil.copyfile(path, target / shard.name)
        shutil.copyfile(manifest.path, here)  # last: the directory names a bundle once its shards are in
        missing[manifest.name] = Manifest(target, manifest.name, manifest.files, manifest.meta).missing()
    return missing


def _bundles_in(directory: Path) -> list[Manifest]:
    found = find_manifests(directory)
    if not found:
        raise ValueError(f"no bundle manifest ({FORMAT}) in {str(directory)!r}")
    return found


def _fits(paths: list[Path], max_files: int, max_bytes: int) -> bool:
    return len(paths) <= max_files and sum(p.stat().st_size for p in paths) <= max_bytes


def _matches(path: Path, expected: BundleFile) -> bool:
    return path.is_file() and path.stat().st_size == expected.bytes and sha256_file(path) == expected.sha256


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"bundle file names take only [A-Za-z0-9._-], got {name!r}")
