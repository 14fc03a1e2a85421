"""Getting a model from the Hugging Face Hub into the models directory (issue 43): `ridge pull
REPO[:TAG]` (daemon/cli/commands.py) and Ollama's /api/pull (daemon/gateway/ollama_routes.py).

What is fetched: a GGUF repository's file(s) whose name carries the quantization TAG (a split
GGUF's parts together), or a safetensors repository's config, tokenizer and *.safetensors files
with their index; never pickle (.bin, .pth, .pt, .ckpt). Where it lands, as the registry scans it
(daemon/frontend/registry.py): a GGUF as `models_dir/<its file name on the Hub>`, served by its
stem less the tag; a safetensors model as the folder `models_dir/<repo name>`. Files download into
`models_dir/.pull/<owner>--<repo>--<commit>/` (hidden: a dot entry is never served), are checked
against the sha256 the Hub's API gives for LFS files (and the git blob id for the others), and
only then moved in; a mismatch removes the staging folder and names the file. A pull interrupted
keeps the files it completed there and fetches only the rest next time; within a pull a dropped
connection is resumed with a Range request by huggingface_hub itself.

Torch-free and engine-free: the gateway imports it (tests/test_layers.py). huggingface_hub reads
HF_TOKEN, HF_HUB_DISABLE_XET and its other variables itself; HF_ENDPOINT is read here on each
pull, so that a process may change it."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$", re.IGNORECASE)  # llama.cpp's split parts: NAME-00001-of-00003.gguf
TAG_AT_END = re.compile(r"[.\-_]((?:UD-)?(?:I?Q\d\w*|B?F16|F32|FP8))$", re.IGNORECASE)
PICKLE = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
HF_FILES = re.compile(r"(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|"
                      r"tokenizer\.model|special_tokens_map\.json|vocab\.json|merges\.txt|added_tokens\.json|"
                      r"chat_template\.jinja|chat_template\.json|[^/]*\.safetensors|[^/]*\.safetensors\.index\.json)")
STAGING = ".pull"


class PullError(Exception):
    """A pull that cannot be done, in words for the user."""


def default_models_dir(environ=os.environ) -> Path:
    base = environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "ridge" / "models"


def parse_name(name: str) -> tuple[str, str | None]:
    """`hf.co/OWNER/REPO:TAG` (Ollama's form), `OWNER/REPO:TAG` or `OWNER/REPO` -> (repo, tag or
    None). `latest`, Ollama's default tag, is no tag."""
    text = name.strip()
    for prefix in ("https://", "http://"):
        text = text.removeprefix(prefix)
    for host in ("hf.co/", "huggingface.co/"):
        text = text.removeprefix(host)
    repo, _, tag = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", repo) or ".." in repo:
        raise PullError(f"{name!r} is not a Hugging Face repository: give OWNER/REPO[:TAG], e.g. "
                        "unsloth/Qwen3-8B-GGUF:Q8_0")
    return repo, (None if tag in ("", "latest") else tag)


@dataclass
class RemoteFile:
    path: str  # in the repository
    size: int
    sha256: str | None  # LFS files: the Hub's sha256 of the content
    blob_id: str | None  # the git blob id (sha1 of "blob SIZE\0" + content), for files not in LFS


@dataclass
class Plan:
    repo: str
    commit: str
    kind: str  # gguf | safetensors
    files: list[RemoteFile]
    name: str  # the entry it becomes in the models directory: a file name or a folder name
    tags: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _gguf_tag(path: str) -> str:
    """A GGUF's quantization tag: Qwen3-8B-UD-Q4_K_XL-00001-of-00002.gguf -> UD-Q4_K_XL (its stem when
    it carries none)."""
    stem = SPLIT.sub("", Path(path).name[:-len(".gguf")])
    m = TAG_AT_END.search(stem)
    return m.group(1) if m else stem


def _carries(path: str, tag: str) -> bool:
    """The file's name holds the tag as a word of its own, case-insensitive: Q4_K picks x-Q4_K.gguf,
    not x-Q4_K_M.gguf."""
    return re.search(rf"(?<![a-z0-9_]){re.escape(tag.lower())}(?![a-z0-9_])", Path(path).name.lower()) is not None


def pick_gguf(files: list[RemoteFile], tag: str | None, repo: str) -> list[RemoteFile]:
    """The model file(s) of the tag: one GGUF, or one split GGUF's parts. Projector files (mmproj)
    are a vision model's, never the model."""
    models = [f for f in files if not Path(f.path).name.lower().startswith("mmproj")]
    tags = sorted({_gguf_tag(f.path) for f in models}, key=str.lower)
    if tag is None:
        if len(tags) > 1:
            raise PullError(f"{repo} holds several quantizations: name one as {repo}:TAG, TAG one of {', '.join(tags)}")
        chosen = models
    else:
        chosen = [f for f in models if _carries(f.path, tag)]
        if not chosen:
            raise PullError(f"{repo} has no GGUF file tagged {tag}; its tags: {', '.join(tags)}")
    groups = {SPLIT.sub("", f.path[:-len(".gguf")]) for f in chosen}
    if len(groups) > 1:
        raise PullError(f"{repo}:{tag} matches several models ({', '.join(sorted(groups))}); name the tag exactly, one "
                        f"of {', '.join(tags)}")
    return sorted(chosen, key=lambda f: f.path)


def plan(name: str, revision: str | None = None, token: str | None = None) -> Plan:
    """What a pull of `name` (parse_name's forms) fetches, from the Hub's API, nothing downloaded."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    repo, tag = parse_name(name)
    try:
        info = HfApi(endpoint=_endpoint(), token=token).model_info(repo, revision=revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise PullError(f"{repo}: no such repository on the Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise PullError(f"{repo}: no revision {revision!r}") from None
    except HfHubHTTPError as e:
        raise PullError(f"{repo}: the Hub answered {e}") from None
    files = [RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
             for s in info.siblings or []]
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    if ggufs:
        chosen = pick_gguf(ggufs, tag, repo)
        return Plan(repo, info.sha, "gguf", chosen, Path(chosen[0].path).name,
                    sorted({_gguf_tag(f.path) for f in ggufs}, key=str.lower))
    if tag is not None:
        raise PullError(f"{repo} holds no GGUF files: a tag ({tag}) picks one; pull {repo} for its safetensors")
    chosen = [f for f in files if HF_FILES.fullmatch(f.path)]
    if not any(f.path.endswith(".safetensors") for f in chosen) or not any(f.path == "config.json" for f in chosen):
        pickled = [f.path for f in files if f.path.lower().endswith(PICKLE)]
        why = f" (only pickle weights: {', '.join(pickled[:3])}, which ridge never loads)" if pickled else ""
        raise PullError(f"{repo} holds neither GGUF files nor a safetensors model with its config.json{why}")
    return Plan(repo, info.sha, "safetensors", sorted(chosen, key=lambda f: f.path), repo.split("/")[-1])


def _digest(path: Path, f: RemoteFile) -> bool:
    """The file's content is what the Hub says it is: its sha256 (LFS) or git blob id."""
    h = hashlib.sha256() if f.sha256 else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    want = f.sha256 or f.blob_id
    return want is None or h.hexdigest() == want


Progress = Callable[[str, RemoteFile, int], None]  # (event, file, bytes done): start | bytes | verify | done


def _reporting_tqdm(report: Progress, f: RemoteFile):
    """huggingface_hub's bar class, quiet, counting the bytes for `report` (Ollama's lines). Raising
    from update() is how a pull whose client went away stops mid-file."""
    from huggingface_hub.utils import tqdm

    class Reporting(tqdm):
        def __init__(self, *a, **kw):
            kw["disable"] = True
            super().__init__(*a, **kw)
            self.done = 0

        def update(self, n=1):
            self.done += n or 0
            report("bytes", f, self.done)
            return super().update(n)

    return Reporting


def pull(p: Plan, models_dir: Path, report: Progress | None = None, token: str | None = None) -> Path:
    """Download, verify and move the plan's files in; -> the new entry of the models directory.
    report: None shows huggingface_hub's progress bars (the terminal's); else it is told each step."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / p.name
    if target.exists():
        if p.kind == "gguf" and all((models_dir / Path(f.path).name).is_file() for f in p.files):
            return target  # pulled before: the files are in place
        raise PullError(f"{target} already exists: remove it to pull {p.repo} again")
    staging = models_dir / STAGING / f"{p.repo.replace('/', '--')}--{p.commit[:12]}"
    staging.mkdir(parents=True, exist_ok=True)
    for f in p.files:
        if report:
            report("start", f, 0)
        try:
            local = Path(hf_hub_download(p.repo, f.path, revision=p.commit, local_dir=staging, endpoint=_endpoint(),
                                         token=token, tqdm_class=_reporting_tqdm(report, f) if report else None))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:  # completed files stay staged for next time
            raise PullError(f"{f.path} from {p.repo}: {e}; pull again to resume") from None
        if report:
            report("verify", f, f.size)
        if not _digest(local, f):
            shutil.rmtree(staging, ignore_errors=True)
            raise PullError(f"{f.path} from {p.repo} does not match the Hub's checksum "
                            f"({'sha256 ' + f.sha256 if f.sha256 else 'git blob ' + str(f.blob_id)}); nothing was kept")
        if report:
            report("done", f, f.size)
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping of the download
    if p.kind == "gguf":
        for f in p.files:
            os.replace(staging / f.path, models_dir / Path(f.path).name)
    else:
        os.replace(staging, target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        (models_dir / STAGING).rmdir()
    except OSError:
        pass  # another pull's files are still there
    return target
