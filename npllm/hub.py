"""Model names -> files on disk: the embedded default model, then local folders, then the Hugging Face hub.

"stories260K" ships inside the package (npllm/data/stories260K, see its NOTICE), so the default model needs no
network and no weights folder. Other known names resolve to $NPLLM_WEIGHTS/<name>/, else to the user cache
($XDG_CACHE_HOME/npllm/<name>/, or ~/.cache/npllm/<name>/), and are downloaded into the cache when absent — never
into the current directory. Downloads come from the Hugging Face hub, or from the server $NPLLM_HUB_URL names
(a mirror answering <url>/<owner>/<repo>/resolve/main/<file> as the hub does).

A download streams into <dest>.part beside its destination, follows the hub's redirects (it answers 302 to a CDN),
resumes a .part left by an interrupted run with an HTTP Range request (or restarts it when the server will not
resume), ends with a DownloadError when no byte arrives for `timeout` seconds, checks the length and sha256, and
only then renames the file into place. One process at a time fetches a given file: the others wait on a lock file
and then find it complete. A failed download removes the folders it made while they are empty, and the error for a
known name says where npllm looked and what to set (offline, say).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

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
# Known models shipped as package data: name -> (checkpoint, tokenizer) file names in npllm/data/<name>/.
EMBEDDED = {"stories260K": ("stories260K.bin", "tok512.bin")}
DATA_DIR = Path(__file__).resolve().parent / "data"


def cache_dir() -> Path:
    """The user cache downloads go to: $XDG_CACHE_HOME/npllm, else ~/.cache/npllm."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "npllm"


def weights_dirs() -> list[Path]:
    """Where named models are looked for, in order: $NPLLM_WEIGHTS, then the user cache."""
    dirs = []
    if os.environ.get("NPLLM_WEIGHTS"):
        dirs.append(Path(os.environ["NPLLM_WEIGHTS"]))
    dirs.append(cache_dir())
    return dirs


def embedded(name: str) -> tuple[Path, Path] | None:
    """(checkpoint, tokenizer) of a model shipped inside the package, or None."""
    if name not in EMBEDDED:
        return None
    checkpoint, tokenizer = (DATA_DIR / name / f for f in EMBEDDED[name])
    return (checkpoint, tokenizer) if checkpoint.is_file() and tokenizer.is_file() else None


def resolve(model: str | os.PathLike, download_missing: bool = True) -> tuple[Path, Path | None]:
    """(checkpoint path, tokenizer path or None) for a path or a known model name."""
    name = str(model)
    if name not in KNOWN_MODELS:
        path = Path(model)
        if path.exists():
            check_readable(path, "model")
            return path, find_tokenizer(path)
        known = ", ".join(KNOWN_MODELS)
        raise FormatError(f"model {name!r} is neither an existing path nor a known model name ({known})")
    shipped = embedded(name)
    if shipped is not None:
        return shipped
    known_model = KNOWN_MODELS[name]
    for folder in weights_dirs():
        checkpoint = folder / name / known_model.checkpoint.name
        tokenizer = folder / name / known_model.tokenizer.name
        if checkpoint.exists() and tokenizer.exists():
            return checkpoint, tokenizer
    if not download_missing:
        raise FormatError(f"model {name!r} is not in {', '.join(str(d) for d in weights_dirs())}")
    folder = cache_dir() / name
    try:
        return (fetch(known_model.checkpoint, folder / known_model.checkpoint.name),
                fetch(known_model.tokenizer, folder / known_model.tokenizer.name))
    except DownloadError as e:
        raise DownloadError(f"{e}. {ways_out(name, known_model)}") from None


def ways_out(name: str, known_model: KnownModel) -> str:
    """What a user can do when a known model is on no disk and its download failed (offline, say): where npllm
    looks, and the settings that change it, named in full."""
    files = f"{known_model.checkpoint.name} and {known_model.tokenizer.name}"
    weights = os.environ.get("NPLLM_WEIGHTS")
    where = f"$NPLLM_WEIGHTS/{name}/ ({Path(weights) / name})" if weights else f"$NPLLM_WEIGHTS/{name}/ (unset)"
    hub = os.environ.get("NPLLM_HUB_URL", DEFAULT_HUB)
    return (f"Model {name!r} is in neither {where} nor the cache ({cache_dir() / name}): put {files} in one of "
            f"them, give the path of a checkpoint instead of the name, or set NPLLM_HUB_URL to a server that "
            f"answers as the Hugging Face hub does (now {hub})")


def check_readable(path: Path, what: str) -> None:
    """A checkpoint or tokenizer must be a regular file or a directory: reading a FIFO or a device would block
    or never end."""
    if not (path.is_file() or path.is_dir()):
        raise FormatError(f"{what} {path} is not a regular file or a directory")


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
    """Fetch url into dest: resumable .part file, redirects followed, stall timeout, sha256 checked, atomic rename.

    Concurrent calls for the same dest (threads or processes) take turns on a lock file; the ones that wait find
    the file complete and return it. A .part whose resumed bytes fail the checksum is discarded and fetched afresh
    once. On failure dest is absent; a .part is kept only when the transfer broke off (to resume next time).
    """
    dest = Path(dest)
    created = make_folder(dest.parent)
    part = dest.with_name(dest.name + ".part")
    try:
        with _exclusive(dest.with_name(f".{dest.name}.lock")):
            if dest.exists():  # another process finished it while this one waited
                return dest
            try:
                try:
                    _transfer(url, part, sha256, progress, timeout)
                except _ResumedBadChecksum:
                    part.unlink(missing_ok=True)
                    _transfer(url, part, sha256, progress, timeout)
            except _BadChecksum as e:
                part.unlink(missing_ok=True)
                raise DownloadError(str(e)) from None
            os.replace(part, dest)
    except BaseException:
        remove_empty(created)  # a failed try leaves no empty folder behind (a .part to resume keeps its own)
        raise
    return dest


def make_folder(folder: Path) -> list[Path]:
    """Make the folder a download goes to, or say in one line why it cannot be made (a file in its path, no
    permission): $XDG_CACHE_HOME pointing at a file is a setting to fix, not a crash. Returns the folders it made,
    deepest first, for remove_empty."""
    absent = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        hint = " (set XDG_CACHE_HOME to a folder, or put the model in $NPLLM_WEIGHTS)" if folder.is_relative_to(
            cache_dir()) else ""
        raise DownloadError(f"cannot make the folder {folder} to download into: {e.strerror or e}{hint}") from None
    return absent


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders (deepest first) while they are empty: one that holds anything (a .part kept to resume,
    another process's download) stays, and so do the folders above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


class _BadChecksum(Exception):
    pass


class _ResumedBadChecksum(_BadChecksum):
    pass


def _transfer(url: str, part: Path, sha256: str | None, progress: bool, timeout: float) -> None:
    """Bring `part` to the complete, verified file: resume from its current length when the server agrees
    (206 with a matching Content-Range), else start over."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the .part is as long as the file or longer: not resumable, start over
            part.unlink()
            return _transfer(url, part, sha256, progress, timeout)
        raise DownloadError(f"could not download {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise DownloadError(f"could not download {url}: {getattr(e, 'reason', e)}") from None
    with response:
        resumed = have > 0 and response.status == 206 and _range_start(response.headers) == have
        digest = _digest_of(part) if resumed else hashlib.sha256()
        have = have if resumed else 0
        length = int(response.headers.get("Content-Length") or 0) or None
        expected_size = None if length is None else have + length
        expected_sha = sha256 or _hub_sha256(response.headers)
        if expected_sha is None:
            raise DownloadError(f"no sha256 is known for {url}: refusing to keep an unverified file")
        received = _receive(url, response, part, resumed, have, expected_size, digest, progress, timeout)
    if expected_size is not None and received != expected_size:
        raise DownloadError(f"download of {url} was truncated: {received:,} of {expected_size:,} bytes "
                            f"(kept in {part} to resume from)")
    if digest.hexdigest() != expected_sha.lower():
        error = _ResumedBadChecksum if resumed else _BadChecksum
        raise error(f"download of {url} does not match its checksum: sha256 {digest.hexdigest()}, "
                    f"expected {expected_sha}")


def _digest_of(part: Path):
    """A sha256 already fed with the bytes a resumed download keeps."""
    digest = hashlib.sha256()
    with open(part, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest


def _receive(url, response, part: Path, resumed: bool, have: int, expected_size, digest, progress: bool,
             timeout: float) -> int:
    """Append (resumed) or write the response's body to `part`, feeding `digest`; returns the bytes `part` holds."""
    received = have
    try:
        with open(part, "ab" if resumed else "wb") as out, \
                _progress_bar(expected_size, part.name.removesuffix(".part"), progress) as bar:
            bar.update(have)
            while chunk := response.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    except TimeoutError:
        raise DownloadError(f"download of {url} stalled: no data for {timeout:g} s ({received:,} bytes kept in "
                            f"{part} to resume from)") from None
    except (http.client.HTTPException, OSError) as e:
        raise DownloadError(f"download of {url} was truncated: the connection broke off after {received:,} bytes "
                            f"({e}; kept in {part} to resume from)") from None
    return received


def _range_start(headers) -> int | None:
    """The first byte a 206 answer holds, from `Content-Range: bytes START-END/TOTAL`."""
    value = headers.get("Content-Range") or ""
    unit, _, span = value.partition(" ")
    start = span.split("-", 1)[0]
    return int(start) if unit == "bytes" and start.isdigit() else None


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on lock_path (created if needed, removed when released).

    The holder unlinks the file before letting go, so a waiter that then gets the lock checks it still holds the
    file at that name, and otherwise tries again on the new one.
    """
    if fcntl is None:  # no flock (Windows): callers still never see a half-written dest (atomic rename)
        yield
        return
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DownloadError(f"cannot make the lock file {lock_path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    lock_path.unlink(missing_ok=True)
                return
        finally:
            os.close(fd)


def _hub_sha256(headers) -> str | None:
    """The hub names a large (LFS) file's sha256 in its X-Linked-ETag header."""
    etag = (headers.get("X-Linked-ETag") or "").strip('"').removeprefix("W/").strip('"')
    return etag if len(etag) == 64 and all(c in "0123456789abcdef" for c in etag.lower()) else None


def _progress_bar(total: int | None, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"downloading {name}",
                file=sys.stderr, disable=not enabled, leave=False)
