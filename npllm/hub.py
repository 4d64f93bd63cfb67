"""Model names -> files on disk, downloading the known models from the Hugging Face hub when they are absent.

A name resolves to $NPLLM_WEIGHTS/<name>/, else ./weights/<name>/. A download streams into a temporary file in the
destination folder, checks its length and sha256, and only then renames it into place, so an interrupted or
corrupted transfer never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, FormatError

DEFAULT_HUB = "https://huggingface.co"


@dataclass(frozen=True)
class RemoteFile:
    repo: str  # "owner/name" on the hub
    path: str  # path inside the repo
    sha256: str | None  # None: trust the hub's own sha256 (its X-Linked-ETag header for large files)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def url(self) -> str:
        hub = os.environ.get("NPLLM_HUB_URL", DEFAULT_HUB).rstrip("/")
        return f"{hub}/{self.repo}/resolve/main/{self.path}"


@dataclass(frozen=True)
class KnownModel:
    checkpoint: RemoteFile
    tokenizer: RemoteFile


LLAMA2_TOKENIZER = RemoteFile("hf-internal-testing/llama-tokenizer", "tokenizer.model",
                              "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347")
KNOWN_MODELS = {
    "stories260K": KnownModel(
        RemoteFile("karpathy/tinyllamas", "stories260K/stories260K.bin",
                   "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696"),
        RemoteFile("karpathy/tinyllamas", "stories260K/tok512.bin",
                   "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312")),
    "stories15M": KnownModel(
        RemoteFile("karpathy/tinyllamas", "stories15M.bin",
                   "cd590644d963867a2b6e5a1107f51fad663c41d79c149fbecbbb1f95fa81f49a"), LLAMA2_TOKENIZER),
    "stories42M": KnownModel(RemoteFile("karpathy/tinyllamas", "stories42M.bin", None), LLAMA2_TOKENIZER),
    "stories110M": KnownModel(RemoteFile("karpathy/tinyllamas", "stories110M.bin", None), LLAMA2_TOKENIZER),
}

TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "tokenizer.bin")


def weights_dirs() -> list[Path]:
    """Where named models are looked for, in order."""
    dirs = []
    if os.environ.get("NPLLM_WEIGHTS"):
        dirs.append(Path(os.environ["NPLLM_WEIGHTS"]))
    dirs.append(Path("weights"))
    return dirs


def resolve(model: str | os.PathLike, download_missing: bool = True) -> tuple[Path, Path | None]:
    """(checkpoint path, tokenizer path or None) for a path or a known model name."""
    name = str(model)
    if name not in KNOWN_MODELS:
        path = Path(model)
        if path.exists():
            return path, find_tokenizer(path)
        known = ", ".join(KNOWN_MODELS)
        raise FormatError(f"model {name!r} is neither an existing path nor a known model name ({known})")
    known_model = KNOWN_MODELS[name]
    for folder in weights_dirs():
        checkpoint = folder / name / known_model.checkpoint.name
        tokenizer = folder / name / known_model.tokenizer.name
        if checkpoint.exists() and tokenizer.exists():
            return checkpoint, tokenizer
    if not download_missing:
        raise FormatError(f"model {name!r} is not in {', '.join(str(d) for d in weights_dirs())}")
    folder = weights_dirs()[0] / name
    return (fetch(known_model.checkpoint, folder / known_model.checkpoint.name),
            fetch(known_model.tokenizer, folder / known_model.tokenizer.name))


def find_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer that sits beside a checkpoint: tokenizer.{json,model,bin}, or tok<V>.{model,bin} (llama2.c);
    for a GGUF file, the file itself."""
    if checkpoint.is_file() and checkpoint.suffix == ".gguf":
        return checkpoint  # a GGUF file carries its own vocabulary in its metadata
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    candidates = [folder / n for n in TOKENIZER_NAMES]
    candidates += sorted(folder.glob("tok*.bin")) + sorted(folder.glob("tok*.model"))
    for candidate in candidates:
        if candidate.is_file() and candidate != checkpoint:
            return candidate
    return None


def fetch(remote: RemoteFile, dest: Path) -> Path:
    """Return dest, downloading it first when it is not there yet."""
    if not dest.exists():
        download(remote.url(), dest, remote.sha256)
    return dest


def download(url: str, dest: Path, sha256: str | None, progress: bool = True, timeout: float = 60.0) -> Path:
    """Stream url into dest atomically: a .part file in the same folder, length and sha256 checked, then renamed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            expected_size = int(response.headers.get("Content-Length") or 0) or None
            expected_sha = sha256 or _hub_sha256(response.headers)
            digest, received = hashlib.sha256(), 0
            with _progress_bar(expected_size, dest.name, progress) as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
        if expected_size is not None and received != expected_size:
            raise DownloadError(f"download of {url} was truncated: {received:,} of {expected_size:,} bytes")
        if expected_sha is None:
            raise DownloadError(f"no sha256 is known for {url}: refusing to keep an unverified file")
        if digest.hexdigest() != expected_sha.lower():
            raise DownloadError(f"download of {url} does not match its checksum: sha256 {digest.hexdigest()}, "
                                f"expected {expected_sha}")
        os.replace(part, dest)
        return dest
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        if isinstance(e, DownloadError):
            raise
        raise DownloadError(f"could not download {url} to {dest}: {e}") from e
    finally:
        part.unlink(missing_ok=True)


def _hub_sha256(headers) -> str | None:
    """The hub names a large (LFS) file's sha256 in its X-Linked-ETag header."""
    etag = (headers.get("X-Linked-ETag") or "").strip('"').removeprefix("W/").strip('"')
    return etag if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag.lower()) else None


def _progress_bar(total: int | None, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"downloading {name}",
                file=sys.stderr, disable=not enabled, leave=False)
