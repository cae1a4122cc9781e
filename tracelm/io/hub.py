"""Models from the Hugging Face Hub and from the local Hugging Face and Ollama caches.

`hf:ORG/REPO[:SELECTOR]` is downloaded through `huggingface_hub`, so its cache (HF_HOME / HF_HUB_CACHE), its token
(HF_TOKEN or `hf auth login`), its offline rule (HF_HUB_OFFLINE=1: the cache only), its endpoint (HF_ENDPOINT),
resumable downloads and progress bars all apply. SELECTOR is a file of the repo (`model-Q4_K_M.gguf`), or a quant
type (`Q4_K_M`) picking the one .gguf file whose name holds it; without one, a repo with config.json and safetensors
gives its folder (config, tokenizer, weights: `snapshot_download`), a repo of GGUF files its only one (or its
Q4_K_M when it holds several).

Names already on disk resolve without the network: `ORG/REPO` (and `ORG/REPO:SELECTOR`) in the Hugging Face cache,
and Ollama's models (`ollama:NAME[:TAG]`, or `NAME:TAG` when Ollama has it) from its manifests
($OLLAMA_MODELS, default ~/.ollama/models: manifests/HOST/NAMESPACE/MODEL/TAG name the GGUF blob
blobs/sha256-HEX by its layer of media type application/vnd.ollama.image.model).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracelm.state.errors import TracelmError

FOLDER_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]  # what a safetensors folder needs
DEFAULT_QUANT = "Q4_K_M"
OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_HOST = "registry.ollama.ai"


def parse(spec: str) -> tuple[str, str | None]:
    """`[hf:]ORG/REPO[:SELECTOR]` -> (repo id, selector or None), checked."""
    body = spec[3:] if spec.startswith("hf:") else spec
    repo, _, selector = body.partition(":")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise TracelmError(f"{spec!r}: expected hf:ORG/REPO, hf:ORG/REPO:FILE or hf:ORG/REPO:QUANT")
    return repo, selector or None


@contextlib.contextmanager
def _progress(on: bool) -> Iterator[None]:
    """huggingface_hub's progress bars off inside the block unless `on` (they go to stderr)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    if not on and not was_off:
        disable_progress_bars()
    try:
        yield
    finally:
        if not on and not was_off:
            enable_progress_bars()


def _hub_error(spec: str, e: Exception) -> TracelmError:
    """One line for a huggingface_hub failure, naming the repo and what to do."""
    from huggingface_hub import errors

    name = type(e).__name__
    if isinstance(e, errors.GatedRepoError):
        why = "the repository is gated: accept its terms on the Hub and log in (HF_TOKEN or `hf auth login`)"
    elif isinstance(e, errors.RepositoryNotFoundError):
        why = "no such repository (or it is private: set HF_TOKEN or run `hf auth login`)"
    elif isinstance(e, errors.RevisionNotFoundError):
        why = "no such revision"
    elif isinstance(e, errors.EntryNotFoundError | errors.LocalEntryNotFoundError):
        offline = " (HF_HUB_OFFLINE is set: only the local cache is read)" if _offline() else ""
        why = f"not found on the Hub or in the local cache{offline}"
    elif isinstance(e, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set and the cache does not hold it"
    else:
        why = f"{name}: {str(e).splitlines()[0] if str(e) else ''}"
    return TracelmError(f"{spec}: {why}")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def pull(spec: str, progress: bool = True) -> Path:
    """Download `hf:ORG/REPO[:SELECTOR]` into the Hugging Face cache (or find it there) and return the GGUF file or
    the model folder."""
    from huggingface_hub import errors, hf_hub_download, snapshot_download

    repo, selector = parse(spec)
    try:
        with _progress(progress):
            if selector is not None and "." in selector:
                return Path(hf_hub_download(repo, selector))
            files = _repo_files(repo)
            if selector is None and "config.json" in files and any(f.endswith(".safetensors") for f in files):
                return Path(snapshot_download(repo, allow_patterns=FOLDER_FILES))
            return Path(hf_hub_download(repo, pick_gguf(spec, files, selector)))
    except (errors.HfHubHTTPError, errors.EntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise _hub_error(spec, e) from None
    except TracelmError:
        raise
    except Exception as e:  # the Hub unreachable and no cached copy, a full disk, ... (httpx's errors included)
        raise TracelmError(f"{spec}: download failed: {type(e).__name__}: {e}") from None


def _repo_files(repo: str) -> list[str]:
    """The files of the repo: listed by the Hub, or -- offline, or when the Hub cannot be reached -- those of its
    snapshot in the local cache."""
    from huggingface_hub import HfApi, errors

    if not _offline():
        try:
            return HfApi().list_repo_files(repo)
        except errors.HfHubHTTPError:
            raise
        except Exception as e:  # the Hub unreachable (httpx's errors, OSError): the cached snapshot's list
            cached = _cached_files(repo)
            if cached is None:
                raise errors.LocalEntryNotFoundError(str(e)) from None
            return cached
    cached = _cached_files(repo)
    if cached is None:
        raise errors.LocalEntryNotFoundError(f"{repo} is not in the cache")
    return cached


def _snapshot(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo` at `revision` (huggingface_hub's cache layout), or None."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    try:
        commit = (root / "refs" / revision).read_text().strip()
    except OSError:
        return None
    folder = root / "snapshots" / commit
    return folder if folder.is_dir() else None


def _cached_files(repo: str) -> list[str] | None:
    folder = _snapshot(repo)
    if folder is None:
        return None
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def pick_gguf(spec: str, files: list[str], quant: str | None) -> str:
    """The .gguf file of `files` that `quant` names (a whole word of its name, any case: Q4_K_M matches
    `model-q4_k_m.gguf`, not `model-Q4_K_M-imat.gguf`'s neighbour `Q4_K_S`); without one, the only .gguf or the
    Q4_K_M one."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not ggufs:
        raise TracelmError(f"{spec}: the repository holds no .gguf file and no config.json + safetensors")
    if quant is None:
        if len(ggufs) == 1:
            return ggufs[0]
        quant = DEFAULT_QUANT
    word = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9_])")
    hits = [f for f in ggufs if word.search(Path(f).name.lower())]
    if len(hits) == 1:
        return hits[0]
    quants = ", ".join(sorted(_quant_of(f) for f in ggufs))
    if not hits:
        raise TracelmError(f"{spec}: no .gguf file of quant {quant} (the repository has: {quants}); name one as "
                           f"hf:ORG/REPO:QUANT or hf:ORG/REPO:FILE")
    raise TracelmError(f"{spec}: {len(hits)} .gguf files match {quant} ({', '.join(hits)}); name the file")


def _quant_of(name: str) -> str:
    m = re.search(r"(?i)(?<![a-z0-9])(i?q\d+_[a-z0-9_]+|f16|bf16|f32)(?=\.gguf$|[-.])", Path(name).name)
    return m.group(1) if m else Path(name).name


# ---- the local caches, by name ----


def cached_hf(name: str) -> Path | None:
    """`ORG/REPO[:SELECTOR]` from the local Hugging Face cache alone (no network): its folder, or its GGUF file."""
    try:
        repo, selector = parse(name)
    except TracelmError:
        return None
    folder = _snapshot(repo)
    if folder is None:
        return None
    files = _cached_files(repo) or []
    if selector is not None and "." in selector:
        return folder / selector if (folder / selector).is_file() else None
    if selector is None and (folder / "config.json").is_file() and any(f.endswith(".safetensors") for f in files):
        return folder
    try:
        return folder / pick_gguf(name, files, selector)
    except TracelmError:
        return None


def hf_cache_models() -> list[tuple[str, Path]]:
    """Every model in the local Hugging Face cache as (name for --model, path): a folder as hf:ORG/REPO, each GGUF
    file as hf:ORG/REPO:FILE."""
    from huggingface_hub import constants

    out = []
    for root in sorted(Path(constants.HF_HUB_CACHE).glob("models--*--*")):
        repo = root.name[len("models--"):].replace("--", "/", 1)
        folder = _snapshot(repo)
        if folder is None:
            continue
        files = _cached_files(repo) or []
        if (folder / "config.json").is_file() and any(f.endswith(".safetensors") for f in files):
            out.append((f"hf:{repo}", folder))
        out += [(f"hf:{repo}:{f}", folder / f) for f in files if f.lower().endswith(".gguf")]
    return out


def ollama_home() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _ollama_name(manifest: Path, root: Path) -> str:
    """manifests/HOST/NAMESPACE/MODEL/TAG -> MODEL:TAG (library models of Ollama's registry), else the path's."""
    host, namespace, model, tag = manifest.relative_to(root).parts[-4:]
    if host == OLLAMA_HOST:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_blob(manifest: Path, home: Path) -> Path | None:
    """The GGUF blob a manifest names, or None (unreadable, no model layer, blob missing)."""
    try:
        data: Any = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL:
            digest = str(layer.get("digest", ""))
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                return None
            blob = home / "blobs" / digest.replace(":", "-")
            return blob if blob.is_file() else None
    return None


def ollama_models() -> list[tuple[str, Path]]:
    """Every model of the local Ollama cache as (name, GGUF blob)."""
    home = ollama_home()
    root = home / "manifests"
    out = []
    for manifest in sorted(p for p in root.glob("*/*/*/*") if p.is_file()):
        blob = _ollama_blob(manifest, home)
        if blob is not None:
            out.append((_ollama_name(manifest, root), blob))
    return out


def cached_ollama(name: str) -> Path | None:
    """`[ollama:]NAME[:TAG]` (TAG latest by default; NAME as `ollama list` shows it) from the Ollama cache."""
    name = name.removeprefix("ollama:")
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return dict(ollama_models()).get(name)


def find_local(name: str) -> Path | None:
    """A model name found in the local caches, without the network: `ollama:NAME[:TAG]`, `ORG/REPO[:SELECTOR]` in
    the Hugging Face cache, or `NAME:TAG` in Ollama's."""
    if name.startswith("ollama:"):
        return cached_ollama(name)
    return cached_hf(name) or cached_ollama(name)
