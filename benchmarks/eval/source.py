"""The codebase the agents are scored on: a pinned source distribution from the Python registry,
fetched once with pip, checked against its sha256 and unpacked into a cache outside the repository.
Every task works in its own fresh copy of it, so no run sees another's edits."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from mlx_subagents.errors import RequestError

CACHE_ENV = "MLX_SUBAGENTS_EVAL_CACHE"
# Left out of copies and of the "which files changed" comparison: Python and pytest write them.
SCRATCH = ("__pycache__", ".pytest_cache", "*.pyc")


class Package(BaseModel):
    """A source distribution pinned by name, version and the sha256 of its archive."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


def default_cache() -> Path:
    """`$MLX_SUBAGENTS_EVAL_CACHE`, else `~/.cache/mlx-subagents/eval`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-subagents" / "eval")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_source(package: Package, cache: Path | None = None) -> Path:
    """The unpacked source tree of `package` (downloaded and checked on first use).

    Raises:
        RequestError: pip could not download it, or the archive's hash is not the pinned one.
    """
    cache = cache or default_cache()
    tree = cache / f"{package.name}-{package.version}-{package.sha256[:12]}"
    if (tree / "PKG-INFO").is_file():
        return tree
    archive = download_sdist(package, cache / "sdists")
    if (actual := sha256_of(archive)) != package.sha256:
        raise RequestError(
            f"{archive}: sha256 is {actual}, the task file pins {package.sha256}; delete the file to download it again"
        )
    with tempfile.TemporaryDirectory(dir=cache, prefix=".unpack-") as tmp, tarfile.open(archive) as tar:
        unpack(tar, Path(tmp))
        (top,) = Path(tmp).iterdir()  # an sdist holds one NAME-VERSION folder
        top.rename(tree)
    return tree


def unpack(tar: tarfile.TarFile, folder: Path) -> None:
    """`tar` unpacked into `folder` through tarfile's "data" filter (nothing outside it, no devices). A
    Python without the filter (before 3.10.12 and 3.11.4: Debian 12's 3.11.2, where every eval test failed
    on the keyword) unpacks the regular files and folders whose paths stay inside `folder`, no link."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(folder, filter="data")
        return
    root = folder.resolve()
    for member in tar.getmembers():
        if (member.isfile() or member.isdir()) and (root / member.name).resolve().is_relative_to(root):
            tar.extract(member, folder, set_attrs=False)


def download_sdist(package: Package, folder: Path) -> Path:
    """`pip download --no-deps --no-binary :all: NAME==VERSION` into `folder` (reused when there)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{package.name.replace('-', '[-_]')}-{package.version}"
    if found := sorted(folder.glob(f"{stem}.tar.gz")):
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(folder)]
    proc = subprocess.run([*cmd, package.pin], capture_output=True, text=True, timeout=600)
    found = sorted(folder.glob(f"{stem}.tar.gz"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no archive was written"])[-1]
        raise RequestError(f"`pip download {package.pin}` failed: {last}; check the network or the pin")
    return found[0]


def fresh_copy(source: Path, dest: Path) -> Path:
    """A new copy of the source tree at `dest` (replacing whatever was there)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*SCRATCH))
    return dest


def changed_files(reference: Path, tree: Path) -> list[str]:
    """Paths (relative, sorted) added, removed or changed in `tree` compared with `reference`,
    scratch files of Python and pytest left aside."""

    def files(root: Path) -> dict[str, Path]:
        found = {}
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and not any(part in SCRATCH or part.endswith(".pyc") for part in rel.parts):
                found[rel.as_posix()] = path
        return found

    before, after = files(reference), files(tree)
    changed = set(before) ^ set(after)
    changed |= {rel for rel in set(before) & set(after) if before[rel].read_bytes() != after[rel].read_bytes()}
    return sorted(changed)
