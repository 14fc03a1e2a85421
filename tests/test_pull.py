"""`ridge pull` and Ollama's /api/pull (daemon/pull.py) against a local server in the Hugging Face
Hub's layout, since tests cannot reach the Hub: the API's model info with its files' sha256
(`GET /api/models/REPO[/revision/REV]`) and the resolve URLs (`HEAD`/`GET /REPO/resolve/REV/PATH`,
with the ETag, X-Repo-Commit and X-Linked-Etag/-Size headers, and Range). huggingface_hub 2.4 is
pointed at it by HF_ENDPOINT; the server sends no Xet headers, so downloads are plain HTTP and
HF_HUB_DISABLE_XET is not needed. Pulled models are loaded through the real loader and must
generate what their source files generate."""
from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine_utils import greedy, make_engine, run
from ridge.daemon.frontend.registry import scan
from ridge.daemon.pull import PullError, plan, pull
from test_daemon_harness import Daemon, daemon_env
from test_gateway import free_port, wait_http
from tiny_models import make_tiny

COMMIT = "c0ffee" * 6 + "abcd"
GGUF_REPO, HF_REPO = "acme/Tiny-GGUF", "acme/tiny-hf"


class Hub(http.server.ThreadingHTTPServer):
    """repos: name -> {path: bytes}; lfs: the paths stored in LFS (sha256 given, X-Linked-* sent).
    claimed: path -> the sha256 the API says (a wrong one: a checksum mismatch). drop_once: paths
    whose first GET sends half the body and closes. fail: paths answered 403. log: (method, path, Range)."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.claimed: dict[str, str] = {}
        self.drop_once: set[str] = set()
        self.fail: set[str] = set()
        self.log: list[tuple] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @staticmethod
    def lfs(path: str) -> bool:
        return path.endswith((".gguf", ".safetensors", ".bin"))


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass  # quiet: the test's output is pytest's

    def _json(self, obj, status=200, code=None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)  # how the Hub tells a missing repository
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _info(self, repo: str):
        files = self.server.repos.get(repo)
        if files is None:
            return self._json({"error": "Repository not found"}, 404, "RepoNotFound")
        siblings = []
        for path, data in files.items():
            s = {"rfilename": path, "size": len(data), "blobId": blob_id(data)}
            if Hub.lfs(path):
                s["lfs"] = {"size": len(data), "pointerSize": 134,
                            "sha256": self.server.claimed.get(path, hashlib.sha256(data).hexdigest())}
            siblings.append(s)
        self._json({"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings, "private": False})

    def _resolve(self, head: bool):
        owner, name, _, rev, path = self.path.lstrip("/").split("/", 4)
        files = self.server.repos.get(f"{owner}/{name}", {})
        self.server.log.append((self.command, path, self.headers.get("Range")))
        if path not in files or rev != COMMIT or path in self.server.fail:  # 403: not retried, unlike a 5xx
            self.send_response(404 if path not in files else 403)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        data = files[path]
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        etag = hashlib.sha256(data).hexdigest() if Hub.lfs(path) else blob_id(data)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", COMMIT)
        if Hub.lfs(path):
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(data)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if head:
            return
        if path in self.server.drop_once and not start:
            self.server.drop_once.discard(path)
            self.wfile.write(data[:len(data) // 2])  # half, then the connection drops
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(data[start:])

    def do_HEAD(self):
        self._resolve(True)

    def do_GET(self):
        p = self.path.split("?")[0]
        if p.startswith("/api/models/"):
            repo = p.removeprefix("/api/models/").split("/revision/")[0]
            return self._info(repo)
        self._resolve(False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny GGUF and a tiny safetensors model, as make_tiny writes them."""
    tmp = tmp_path_factory.mktemp("sources")
    gguf, _, _ = make_tiny(tmp, "llama")
    hf, _, _ = make_tiny(tmp, "llama", fmt="hf")
    return gguf, hf


@pytest.fixture
def hub(sources, monkeypatch):
    gguf, hf = sources
    h = Hub()
    data = gguf.read_bytes()
    h.repos[GGUF_REPO] = {"Tiny-Q8_0.gguf": data, "Tiny-F16.gguf": data + b"", "mmproj-F16.gguf": b"proj",
                          "README.md": b"# tiny\n"}
    files = {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()}
    h.repos[HF_REPO] = {**files, "pytorch_model.bin": b"pickle: never fetched", "README.md": b"# tiny hf\n"}
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield h
    h.shutdown()


def generates_as(path: Path, source: Path):
    """The pulled model, through the real loader, generates what its source does."""
    from ridge.models.loader import load_model

    def tokens(p):
        return list(run(make_engine(load_model(p, device="cpu", weights="fp32", use_cache=False, show_progress=False)),
                        [[3, 4, 5, 6]], greedy(6)).values())

    got = tokens(path)
    assert got == tokens(source) and len(got[0]) == 6


def test_gguf_by_tag_is_pulled_verified_listed_and_runs(hub, sources, tmp_path):
    p = plan(f"hf.co/{GGUF_REPO}:q8_0")  # Ollama's form; the tag in any case
    assert [f.path for f in p.files] == ["Tiny-Q8_0.gguf"] and p.tags == ["F16", "Q8_0"]
    seen = []
    path = pull(p, tmp_path / "models", lambda ev, f, n: seen.append((ev, f.path, n)))
    assert path == tmp_path / "models" / "Tiny-Q8_0.gguf"
    assert seen[0] == ("start", "Tiny-Q8_0.gguf", 0) and seen[-1][0] == "done" and ("verify", "Tiny-Q8_0.gguf",
                                                                                     path.stat().st_size) in seen
    assert sorted(x.name for x in (tmp_path / "models").iterdir()) == ["Tiny-Q8_0.gguf"]  # no staging left
    assert list(scan(tmp_path / "models")) == ["Tiny"]  # the registry serves it by its stem less the tag
    generates_as(path, sources[0])
    assert pull(plan(f"{GGUF_REPO}:Q8_0"), tmp_path / "models") == path  # again: already there


def test_tags_pick_one_model_or_say_which_exist(hub):
    with pytest.raises(PullError, match=r"several quantizations: .*TAG one of F16, Q8_0"):
        plan(GGUF_REPO)
    with pytest.raises(PullError, match=r"no GGUF file tagged Q4_K_M; its tags: F16, Q8_0"):
        plan(f"{GGUF_REPO}:Q4_K_M")
    with pytest.raises(PullError, match="no such repository"):
        plan("acme/missing:Q8_0")
    with pytest.raises(PullError, match="not a Hugging Face repository"):
        plan("../etc:Q8_0")
    hub.repos["acme/split"] = {"M-Q8_0-00001-of-00002.gguf": b"a", "M-Q8_0-00002-of-00002.gguf": b"b",
                               "M-Q4_K_M.gguf": b"c"}
    assert [f.path for f in plan("acme/split:Q8_0").files] == ["M-Q8_0-00001-of-00002.gguf",
                                                                "M-Q8_0-00002-of-00002.gguf"]  # the parts together
    assert [f.path for f in plan("acme/split:q4_k_m").files] == ["M-Q4_K_M.gguf"]
    hub.repos["acme/pickled"] = {"config.json": b"{}", "pytorch_model.bin": b"x"}
    with pytest.raises(PullError, match="only pickle weights: pytorch_model.bin"):
        plan("acme/pickled")


def test_safetensors_repo_is_pulled_without_pickle_and_runs(hub, sources, tmp_path):
    p = plan(HF_REPO)
    assert p.kind == "safetensors" and "pytorch_model.bin" not in {f.path for f in p.files}
    path = pull(p, tmp_path / "models")
    assert path == tmp_path / "models" / "tiny-hf" and not (path / "pytorch_model.bin").exists()
    assert not (path / ".cache").exists() and "tiny-hf" in scan(tmp_path / "models")
    assert not any(m == "pytorch_model.bin" for _, m, _ in hub.log)
    generates_as(path, sources[1])


def test_a_checksum_mismatch_names_the_file_and_leaves_nothing(hub, tmp_path):
    hub.claimed["Tiny-Q8_0.gguf"] = "0" * 64
    with pytest.raises(PullError, match=r"Tiny-Q8_0.gguf from acme/Tiny-GGUF does not match the Hub's checksum"):
        pull(plan(f"{GGUF_REPO}:Q8_0"), tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == [tmp_path / "models" / ".pull"] and \
        not any((tmp_path / "models" / ".pull").iterdir())
    assert scan(tmp_path / "models") == {}


def test_a_dropped_connection_resumes_and_an_interrupted_pull_continues(hub, sources, tmp_path, monkeypatch):
    """Within a pull, huggingface_hub resumes a dropped download with a Range request; a pull that
    fails midway keeps the files it completed and the next one fetches only the rest."""
    import huggingface_hub.constants

    # huggingface_hub writes what it read in chunks of 10 MB: smaller ones, so that some of the half
    # sent before the drop reaches the file and the retry asks for the rest with a Range
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 15)
    hub.drop_once.add("model.safetensors")
    hub.fail.add("tokenizer.json")
    with pytest.raises(PullError, match="tokenizer.json from acme/tiny-hf: .*pull again to resume"):
        pull(plan(HF_REPO), tmp_path / "models")
    gets = [(p, r) for m, p, r in hub.log if m == "GET"]
    assert ("model.safetensors", None) in gets and any(p == "model.safetensors" and r for p, r in gets)  # resumed
    assert scan(tmp_path / "models") == {}  # nothing served until every file is in and verified
    hub.fail.clear()
    hub.log.clear()
    path = pull(plan(HF_REPO), tmp_path / "models")
    fetched = {p for m, p, _ in hub.log if m == "GET"}
    assert "tokenizer.json" in fetched and "model.safetensors" not in fetched  # kept from the first pull
    generates_as(path, sources[1])


def test_cli_pull_then_models_lists_it(hub, tmp_path):
    env = daemon_env(tmp_path, HF_ENDPOINT=hub.url, RIDGE_MODELS_DIR=tmp_path / "models")
    ridge = [sys.executable, "-m", "ridge.cli"]
    out = subprocess.run(ridge + ["pull", f"{GGUF_REPO}:Q8_0"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "served as 'Tiny'" in out.stdout and (tmp_path / "models" / "Tiny-Q8_0.gguf").is_file()
    listed = subprocess.run(ridge + ["models", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert "Tiny" in {m["name"] for m in json.loads(listed.stdout)["models"]}, listed.stderr
    bad = subprocess.run(ridge + ["pull", GGUF_REPO], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "TAG one of F16, Q8_0" in bad.stderr


def _post(url: str, body: dict) -> tuple[int, list[dict]]:
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/api/pull", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = [json.loads(x) for x in resp.read().splitlines() if x.strip()]
    conn.close()
    return resp.status, lines


def test_ollama_api_pull_streams_ollamas_lines_and_needs_allow_pull(hub, sources, tmp_path):
    """One daemon with its Ollama listener: refused while allow_pull is off (the default), then on."""
    port = free_port()
    d = Daemon(tmp_path, str(sources[0]), "--ollama", f"127.0.0.1:{port}", "--models-dir", tmp_path / "models",
               "--served-model-name", "base", env_extra={"HF_ENDPOINT": hub.url})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url)
        status, lines = _post(url, {"model": f"hf.co/{GGUF_REPO}:Q8_0"})
        assert status == 403 and "allow_pull" in lines[0]["error"]
    finally:
        d.stop()
    (tmp_path / "xdg-config" / "ridge").mkdir(parents=True, exist_ok=True)
    (tmp_path / "xdg-config" / "ridge" / "config.toml").write_text("allow_pull = true\n")
    d = Daemon(tmp_path, str(sources[0]), "--ollama", f"127.0.0.1:{port}", "--models-dir", tmp_path / "models",
               "--served-model-name", "base", env_extra={"HF_ENDPOINT": hub.url})
    try:
        wait_http(url)
        status, lines = _post(url, {"model": f"hf.co/{GGUF_REPO}:Q8_0"})
        assert status == 200, lines
        sha = hashlib.sha256(hub.repos[GGUF_REPO]["Tiny-Q8_0.gguf"]).hexdigest()
        assert lines[0] == {"status": "pulling manifest"} and lines[-2:] == [{"status": "writing manifest"},
                                                                             {"status": "success"}]
        progress = [x for x in lines if x.get("digest")]
        assert progress[0] == {"status": f"pulling {sha[:12]}", "digest": f"sha256:{sha}",
                               "total": len(hub.repos[GGUF_REPO]["Tiny-Q8_0.gguf"]), "completed": 0}
        assert progress[-1]["completed"] == progress[-1]["total"] and {"status": "verifying sha256 digest"} in lines
        tags = json.loads(subprocess.run(["curl", "-s", f"{url}/api/tags"], capture_output=True, text=True).stdout)
        assert "Tiny" in {m["name"] for m in tags["models"]}  # served at once, no restart
        status, lines = _post(url, {"model": f"{HF_REPO}", "stream": False})
        assert (status, lines) == (200, [{"status": "success"}])
        status, lines = _post(url, {"model": f"{GGUF_REPO}:Q2_K", "stream": False})
        assert status == 400 and "its tags: F16, Q8_0" in lines[0]["error"]
    finally:
        d.stop()
