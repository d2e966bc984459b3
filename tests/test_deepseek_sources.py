"""scripts/pack-deepseek-sources and the --archives path of scripts/build-deepseek-kernels, on a fake
library repository with a fake submodule (no network, no GPU)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKER = ROOT / "scripts" / "pack-deepseek-sources"
BUILDER = ROOT / "scripts" / "build-deepseek-kernels"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
pytestmark = [pytestmark, pytest.mark.system]

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z",
    "GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z",
}


def load_packer() -> ModuleType:
    loader = SourceFileLoader("pack_deepseek_sources", str(PACKER))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


pack = load_packer()


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(
        ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
    ).stdout


def make_repo(path: Path, files: dict[str, str]) -> None:
    path.mkdir()
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", ".")
    # Served over file:// to a blob-less clone, as GitHub serves a partial clone.
    git(path, "config", "uploadpack.allowFilter", "true")
    git(path, "config", "uploadpack.allowAnySHA1InWant", "true")


@dataclasses.dataclass
class Fake:
    pin: pack.Pin
    gitdirs: dict[str, Path]


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    sub, lib = tmp_path / "sub", tmp_path / "lib"
    make_repo(sub, {"include/sub.h": "#define SUB 1\n", "include/deep/x.h": "int x;\n",
                    "other/big.txt": "not needed\n", "LICENSE": "sub license\n"})  # fmt: skip
    git(sub, "commit", "-q", "-m", "sub")
    sub_commit = git(sub, "rev-parse", "HEAD").strip()
    make_repo(lib, {"setup.py": "print('setup')\n", "src/a.c": "int a;\n", "src/logo.svg": "<svg/>\n",
                    "docs/guide.md": "# guide\n", "tests/test_x.py": "x = 1\n", "pic.png": "png"})  # fmt: skip
    git(lib, "update-index", "--add", "--cacheinfo", f"160000,{sub_commit},third/sub")
    git(lib, "commit", "-q", "-m", "lib")
    lib_commit = git(lib, "rev-parse", "HEAD").strip()
    pin = pack.Pin(
        key="fake",
        name="Fake",
        commit=lib_commit,
        submodules=(pack.Submodule("third/sub", "sub", sub_commit, ("include", "LICENSE")),),
        drop=("docs", "tests"),
    )
    return Fake(pin, {"fake": lib, "sub": sub})


def members(archive: Path) -> dict[str, bytes | None]:
    with tarfile.open(archive) as tar:
        return {m.name: (tar.extractfile(m).read() if m.isfile() else None) for m in tar}  # type: ignore[union-attr]


def test_pack_places_submodule_and_drops_what_no_build_reads(fake: Fake, tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = pack.pack_all([fake.pin], fake.gitdirs, out)
    archive = out / fake.pin.archive
    got = members(archive)
    assert got["Fake/setup.py"] == b"print('setup')\n"
    assert got["Fake/src/a.c"] == b"int a;\n"
    assert got["Fake/third/sub/include/sub.h"] == b"#define SUB 1\n"
    assert got["Fake/third/sub/include/deep/x.h"] == b"int x;\n"
    assert got["Fake/third/sub/LICENSE"] == b"sub license\n"
    for name in got:
        assert not name.startswith(("Fake/docs", "Fake/tests", "Fake/third/sub/other")), name
        assert not name.endswith((".png", ".svg")), name
    assert len(got) == len(set(got))

    entry = manifest["libraries"]["fake"]
    assert json.loads((out / pack.MANIFEST).read_text()) == manifest
    assert entry["commit"] == fake.pin.commit
    assert entry["submodules"]["third/sub"]["commit"] == fake.pin.submodules[0].commit
    assert entry["archive"] == archive.name == f"Fake-{fake.pin.commit[:12]}.tar.xz"
    assert entry["size"] == archive.stat().st_size
    assert entry["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert entry["files"] == 5
    assert pack.check(out, [fake.pin]) == []

    again = pack.pack_all([fake.pin], fake.gitdirs, tmp_path / "again")  # deterministic
    assert again["libraries"]["fake"]["sha256"] == entry["sha256"]


def test_check_fails_after_one_byte_changes(fake: Fake, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "out"
    pack.pack_all([fake.pin], fake.gitdirs, out)
    monkeypatch.setattr(pack, "PINS", (fake.pin,))
    assert pack.main(["--check", str(out)]) == 0

    archive = out / fake.pin.archive
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0x01
    archive.write_bytes(bytes(data))
    problems = pack.check(out, [fake.pin])
    assert len(problems) == 1 and "sha256" in problems[0]
    capsys.readouterr()
    assert pack.main(["--check", str(out)]) == 1
    assert "FAILED the check" in capsys.readouterr().err


def test_check_holds_the_manifest_to_the_pins(fake: Fake, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack.pack_all([fake.pin], fake.gitdirs, out)
    sub = dataclasses.replace(fake.pin.submodules[0], commit="1" * 40)
    problems = pack.check(out, [dataclasses.replace(fake.pin, submodules=(sub,))])
    assert any("third/sub commit" in p for p in problems)
    other = dataclasses.replace(fake.pin, commit="2" * 40)
    assert any("manifest commit" in p for p in pack.check(out, [other]))
    assert "unreadable manifest" in pack.check(tmp_path / "nowhere", [fake.pin])[0]


def test_a_submodule_commit_other_than_the_pin_is_refused(fake: Fake, tmp_path: Path) -> None:
    sub = dataclasses.replace(fake.pin.submodules[0], commit="3" * 40)
    with pytest.raises(pack.PackError, match=r"records third/sub at .* but the pin says 3333"):
        pack.pack(dataclasses.replace(fake.pin, submodules=(sub,)), fake.gitdirs, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))


def test_blobless_clone_packs_the_same_archive(fake: Fake, tmp_path: Path) -> None:
    """The path taken without --flash-mla etc.: a --filter=blob:none clone, then the needed blobs."""
    want = pack.pack(fake.pin, fake.gitdirs, tmp_path / "local")["sha256"]
    clones = {
        key: pack.clone(key, f"file://{path}", tmp_path / f"clone-{key}", [fake.pin])
        for key, path in fake.gitdirs.items()
    }
    assert pack.pack(fake.pin, clones, tmp_path / "cloned")["sha256"] == want


def test_build_script_help() -> None:
    done = subprocess.run(["bash", str(BUILDER), "--help"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--archives DIR" in done.stdout and "--only flash-mla|deep-gemm" in done.stdout


def test_build_script_stops_at_a_failed_check(fake: Fake, tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    pack.pack_all([fake.pin], fake.gitdirs, out)  # fine for the fake pin, not for the real PINS
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(BUILDER), "--archives", str(out), "--work", str(work)],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1
    assert "FlashMLA: not in" in done.stderr and "FAILED the check" in done.stderr
    assert f"check of {out} failed" in done.stderr
    assert "unpacked" not in done.stderr and "building" not in done.stderr
    assert not work.exists()
