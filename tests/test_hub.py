"""Downloads against a local HTTP server on 127.0.0.1: success, wrong checksum, truncated transfer, no leftovers."""

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import npllm
from npllm import hub
from npllm.errors import DownloadError


class FakeHub:
    """Serves {url path: bytes}; paths listed in `truncate` announce their full length but send half of it."""

    def __init__(self):
        self.files, self.truncate, self.etags = {}, set(), {}
        hub_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = hub_self.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                if self.path in hub_self.etags:
                    self.send_header("X-Linked-ETag", f'"{hub_self.etags[self.path]}"')
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if self.path in hub_self.truncate else body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


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


def test_truncated_transfer_leaves_nothing(fake_hub, tmp_path):
    data = b"x" * 100_000
    fake_hub.files["/f.bin"] = data
    fake_hub.truncate.add("/f.bin")
    with pytest.raises(DownloadError, match="truncated|could not download"):
        hub.download(fake_hub.url + "/f.bin", tmp_path / "f.bin", sha(data), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_missing_file_and_unreachable_server(fake_hub, tmp_path):
    with pytest.raises(DownloadError, match="404"):
        hub.download(fake_hub.url + "/absent.bin", tmp_path / "a.bin", None, progress=False)
    with pytest.raises(DownloadError):
        hub.download("http://127.0.0.1:9/x.bin", tmp_path / "b.bin", None, progress=False, timeout=2)
    assert list(tmp_path.iterdir()) == []


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


def test_known_name_downloads_on_first_load(fake_hub, tmp_path, monkeypatch, stories260k, golden_200):
    """npllm.load("stories260K") on an empty weights folder fetches both files from the hub, then generates."""
    for remote in (hub.KNOWN_MODELS["stories260K"].checkpoint, hub.KNOWN_MODELS["stories260K"].tokenizer):
        fake_hub.files[f"/{remote.repo}/resolve/main/{remote.path}"] = (stories260k.parent / remote.name).read_bytes()
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    llm = npllm.load("stories260K")
    assert sorted(p.name for p in (tmp_path / "stories260K").iterdir()) == ["stories260K.bin", "tok512.bin"]
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200
    fake_hub.files.clear()  # the second load finds the files on disk and never asks the hub
    assert npllm.load("stories260K").generate("", max_new_tokens=200, temperature=0) == golden_200
