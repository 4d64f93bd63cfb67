"""Downloads against a local HTTP server on 127.0.0.1: success, wrong checksum, truncated transfer, no leftovers."""

import hashlib
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import npllm
from npllm import hub
from npllm.errors import DownloadError


class FakeHub:
    """Serves {url path: bytes} as the hub does, on 127.0.0.1.

    truncate: paths that announce their full length but send half of it; redirects: {path: target path}, answered
    302 with an absolute Location (the hub sends files to a CDN this way); stall: paths that send half the body and
    then nothing until the server closes; no_range: paths that ignore Range requests (200, whole body); slow: paths
    sent in 16 pieces with a pause between them, once `gate` is set. Every GET is logged as (path, Range header or
    None).
    """

    def __init__(self):
        self.files, self.truncate, self.etags, self.redirects = {}, set(), {}, {}
        self.stall, self.no_range, self.slow, self.requests = set(), set(), set(), []
        self.release, self.gate = threading.Event(), threading.Event()
        hub_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub_self.requests.append((self.path, self.headers.get("Range")))
                if self.path in hub_self.redirects:
                    self.send_response(302)
                    self.send_header("Location", hub_self.url + hub_self.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = hub_self.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                wanted = self.headers.get("Range")
                if wanted and self.path not in hub_self.no_range:
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                part = body[start:]
                self.send_header("Content-Length", str(len(part)))
                if self.path in hub_self.etags:
                    self.send_header("X-Linked-ETag", f'"{hub_self.etags[self.path]}"')
                self.end_headers()
                if self.path in hub_self.truncate or self.path in hub_self.stall:
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    if self.path in hub_self.stall:
                        hub_self.release.wait(30)
                    return
                if self.path in hub_self.slow:
                    hub_self.gate.wait(30)
                    step = -(-len(part) // 16)
                    for i in range(0, len(part), step):
                        self.wfile.write(part[i:i + step])
                        self.wfile.flush()
                        time.sleep(0.03)
                    return
                self.wfile.write(part)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, path):
        return [r for r in self.requests if r[0] == path]

    def close(self):
        self.release.set()  # a stalled handler returns
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def fake_hub(monkeypatch):
    server = FakeHub()
    monkeypatch.setenv("NPLLM_HUB_URL", server.url)
    yield server
    server.close()


def sha(data):
    return hashlib.sha256(data).hexdigest()


def test_download_checks_sha256_and_renames_atomically(fake_hub, tmp_path):
    data = bytes(range(256)) * 1000
    fake_hub.files["/f.bin"] = data
    dest = hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(data), progress=False)
    assert dest.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_wrong_checksum_leaves_nothing(fake_hub, tmp_path):
    fake_hub.files["/f.bin"] = b"tampered" * 100
    with pytest.raises(DownloadError, match="checksum"):
        hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(b"original"), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_truncated_transfer_leaves_only_a_part_file_that_the_next_try_resumes(fake_hub, tmp_path):
    """A transfer cut short leaves no file that looks complete: only f.bin.part, which the next download resumes
    with a Range request for the bytes it lacks."""
    data = bytes(range(256)) * 400
    fake_hub.files["/f.bin"] = data
    fake_hub.truncate.add("/f.bin")
    with pytest.raises(DownloadError, match="truncated|could not download"):
        hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(data), progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin.part"]
    assert (tmp_path / "f.bin.part").read_bytes() == data[: len(data) // 2]
    fake_hub.truncate.clear()
    assert hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(data), progress=False).read_bytes() == data
    assert fake_hub.gets("/f.bin")[-1] == ("/f.bin", f"bytes={len(data) // 2}-")
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_missing_file_and_unreachable_server(fake_hub, tmp_path):
    with pytest.raises(DownloadError, match="404"):
        hub.download(fake_hub.url + "/absent.bin", tmp_path / "a.bin", None, progress=False)
    with pytest.raises(DownloadError):
        hub.download("http://127.0.0.1:9/x.bin", tmp_path / "b.bin", None, progress=False, timeout=2)
    assert list(tmp_path.iterdir()) == []


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (just freed): a connection there is refused at once, as offline."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_a_hub_name_says_the_ways_out_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """`--model stories15M` with no network: one line that names where npllm looked ($NPLLM_WEIGHTS's folder, the
    cache) and what to set ($NPLLM_HUB_URL), and no empty cache folder left by the failed try."""
    from npllm.cli import main

    monkeypatch.setenv("NPLLM_HUB_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "weights").mkdir()
    assert main(["generate", "Once", "--model", "stories15M", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npllm: error: ") and err.count("\n") == 1, err
    for named in ("NPLLM_WEIGHTS", "NPLLM_HUB_URL", str(tmp_path / "weights" / "stories15M"),
                  str(tmp_path / "cache" / "npllm" / "stories15M"), "stories15M.bin", "tokenizer.model"):
        assert named in err, named
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]  # no cache/npllm/stories15M made and left
    with pytest.raises(DownloadError, match="NPLLM_HUB_URL"):
        npllm.load("stories15M", backend="numpy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


def test_a_failed_download_keeps_folders_that_were_there_or_hold_a_part(fake_hub, tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(DownloadError):
        hub.download(fake_hub.url + "/absent.bin", tmp_path / "kept" / "new" / "deeper" / "a.bin", None,
                     progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "kept"] and list((tmp_path / "kept").iterdir()) == []
    data = bytes(range(256)) * 400
    fake_hub.files["/f.bin"] = data
    fake_hub.truncate.add("/f.bin")
    with pytest.raises(DownloadError):
        hub.download(fake_hub.url + "/f.bin", tmp_path / "new" / "f.bin", sha(data), progress=False)
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["f.bin.part"]  # kept, to resume from


def test_hub_etag_is_the_checksum_when_none_is_known(fake_hub, tmp_path):
    data = b"model bytes" * 50
    fake_hub.files["/m.bin"] = data
    fake_hub.etags["/m.bin"] = sha(data)
    assert hub.download(fake_hub.url + "/m.bin", tmp_path / "m.bin", None, progress=False).read_bytes() == data
    fake_hub.etags["/m.bin"] = sha(b"something else")
    with pytest.raises(DownloadError, match="checksum"):
        hub.download(fake_hub.url + "/m.bin", tmp_path / "n.bin", None, progress=False)
    fake_hub.files["/u.bin"] = data
    with pytest.raises(DownloadError, match="no sha256"):
        hub.download(fake_hub.url + "/u.bin", tmp_path / "u.bin", None, progress=False)


def test_known_name_downloads_into_the_user_cache(fake_hub, tmp_path, monkeypatch, stories260k, golden_200):
    """A known model that is not embedded (here stories260K's files under another name) is fetched from the hub
    into $XDG_CACHE_HOME/npllm/<name>/ — never into the current directory — and found there the next time."""
    source = hub.KNOWN_MODELS["stories260K"]
    monkeypatch.setitem(hub.KNOWN_MODELS, "remote260K", source)
    for remote in (source.checkpoint, source.tokenizer):
        fake_hub.files[f"/{remote.repo}/resolve/main/{remote.path}"] = (stories260k.parent / remote.name).read_bytes()
    monkeypatch.delenv("NPLLM_WEIGHTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    llm = npllm.load("remote260K")
    folder = tmp_path / "cache" / "npllm" / "remote260K"
    assert sorted(p.name for p in folder.iterdir()) == ["stories260K.bin", "tok512.bin"]
    assert list((tmp_path / "cwd").iterdir()) == []
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200
    fake_hub.files.clear()  # the second load finds the files on disk and never asks the hub
    assert npllm.load("remote260K").generate("", max_new_tokens=200, temperature=0) == golden_200


def test_the_default_model_needs_no_network_and_no_weights_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("NPLLM_WEIGHTS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("NPLLM_HUB_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.chdir(tmp_path)
    llm = npllm.load()
    assert llm.generate("Once upon a time", max_new_tokens=8, temperature=0)
    assert hub.resolve("stories260K")[0].parent == hub.DATA_DIR / "stories260K"
    assert list(tmp_path.iterdir()) == []


def test_redirects_to_a_cdn_are_followed(fake_hub, tmp_path):
    data = b"weights" * 1000
    fake_hub.files["/cdn/blob"] = data
    fake_hub.redirects["/org/model/resolve/main/m.bin"] = "/cdn/blob"
    dest = hub.download(fake_hub.url + "/org/model/resolve/main/m.bin", tmp_path / "m.bin", sha(data),
                        progress=False)
    assert dest.read_bytes() == data and len(fake_hub.gets("/cdn/blob")) == 1


def test_a_stale_part_is_resumed_or_restarted(fake_hub, tmp_path):
    data = os.urandom(50_000)
    fake_hub.files["/f.bin"] = data
    (tmp_path / "f.bin.part").write_bytes(data[:20_000])  # left by a killed process
    assert hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(data), progress=False).read_bytes() == data
    assert fake_hub.gets("/f.bin") == [("/f.bin", "bytes=20000-")]
    # a server that ignores Range: the part is rewritten from the start
    fake_hub.no_range.add("/g.bin")
    fake_hub.files["/g.bin"] = data
    (tmp_path / "g.bin.part").write_bytes(data[:20_000])
    assert hub.download(fake_hub.url + "/g.bin", tmp_path / "g.bin", sha(data), progress=False).read_bytes() == data
    # a part as long as the file (416) or with wrong bytes (checksum): discarded and fetched afresh
    (tmp_path / "h.bin.part").write_bytes(b"x" * 60_000)
    fake_hub.files["/h.bin"] = data
    assert hub.download(fake_hub.url + "/h.bin", tmp_path / "h.bin", sha(data), progress=False).read_bytes() == data
    (tmp_path / "i.bin.part").write_bytes(b"x" * 20_000)
    fake_hub.files["/i.bin"] = data
    assert hub.download(fake_hub.url + "/i.bin", tmp_path / "i.bin", sha(data), progress=False).read_bytes() == data
    assert fake_hub.gets("/i.bin") == [("/i.bin", "bytes=20000-"), ("/i.bin", None)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "g.bin", "h.bin", "i.bin"]


def test_a_stalled_transfer_ends_with_a_clear_error(fake_hub, tmp_path):
    data = b"s" * 100_000
    fake_hub.files["/s.bin"] = data
    fake_hub.stall.add("/s.bin")
    start = time.monotonic()
    with pytest.raises(DownloadError, match="stalled: no data for 0.5 s"):
        hub.download(fake_hub.url + "/s.bin", tmp_path / "s.bin", sha(data), progress=False, timeout=0.5)
    assert time.monotonic() - start < 10
    assert not (tmp_path / "s.bin").exists()


DOWNLOAD = """
import sys
from pathlib import Path
from npllm import hub
print("start", flush=True)
print(hub.download(sys.argv[1], Path(sys.argv[2]), sys.argv[3], progress=False).stat().st_size)
"""


def test_two_processes_fetching_the_same_file_do_not_corrupt_it(fake_hub, tmp_path):
    """Both end with the complete file; it is fetched once (the second process waits on the lock, then finds it)."""
    data = os.urandom(400_000)
    fake_hub.files["/big.bin"] = data
    fake_hub.slow.add("/big.bin")
    args = [fake_hub.url + "/big.bin", str(tmp_path / "big.bin"), sha(data)]
    procs = [subprocess.Popen([sys.executable, "-c", DOWNLOAD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    assert [p.stdout.readline().strip() for p in procs] == ["start", "start"]
    time.sleep(1.0)  # both are inside download(): one holds the lock and waits on the server, the other on the lock
    assert len(fake_hub.gets("/big.bin")) == 1
    fake_hub.gate.set()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == [str(len(data))] * 2
    assert (tmp_path / "big.bin").read_bytes() == data
    assert len(fake_hub.gets("/big.bin")) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"]
