"""The compiled CPU kernels' cache is shared by checkouts at different paths and by venvs with the same torch
(ln_lightning/norm/_extension.py).

ninja's build file records the path of what it compiles; the build compiles a copy of the source kept in the
hash-named build directory, so a second checkout (a fresh clone, a CI workspace) finds an identical build file
and nothing to rebuild."""

import os
import shutil
from pathlib import Path

import pytest

from ln_lightning.norm import _cpu_kernels, _extension


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    calls = []

    def load(name, sources, extra_cflags, extra_ldflags=(), verbose=False):
        calls.append((name, list(sources)))
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_two_checkouts_compile_the_same_file_in_the_build_dir(fake_load, tmp_path):
    real = _cpu_kernels.KERNELS.source
    checkouts = []
    for where in ("clone_a", "clone_b/deeper"):
        src = tmp_path / where / real.name
        src.parent.mkdir(parents=True)
        shutil.copyfile(real, src)
        checkouts.append(src)
    _extension.build_extension("ln_test_kernels", checkouts[0], "LayerNorm")
    (name_a, [compiled_a]), = fake_load
    mtime = os.stat(compiled_a).st_mtime_ns
    _extension.build_extension("ln_test_kernels", checkouts[1], "LayerNorm")
    name_b, [compiled_b] = fake_load[1]
    assert name_a == name_b and compiled_a == compiled_b  # one cache entry, one build file
    cache = tmp_path / "cache"
    assert os.path.commonpath([compiled_a, cache]) == str(cache), "compiles a file outside the build dir"
    assert open(compiled_a, "rb").read() == real.read_bytes()
    assert os.stat(compiled_a).st_mtime_ns == mtime  # not rewritten: a newer source would make ninja rebuild
    assert not [p for p in os.listdir(os.path.dirname(compiled_a)) if p.endswith(".tmp")]


def test_a_changed_source_gets_its_own_build_dir_and_copy(fake_load, tmp_path):
    src = tmp_path / "clone" / "k.cpp"
    src.parent.mkdir()
    src.write_text("// v1\n")
    _extension.build_extension("ln_test_kernels", src, "LayerNorm")
    src.write_text("// v2\n")
    _extension.build_extension("ln_test_kernels", src, "LayerNorm")
    (n1, [c1]), (n2, [c2]) = fake_load
    assert n1 != n2 and c1 != c2
    assert open(c1).read() == "// v1\n" and open(c2).read() == "// v2\n"


def test_the_loaded_kernels_were_built_from_the_copy():
    module = _cpu_kernels.KERNELS.module()
    if module is None:
        pytest.skip(f"no compiled kernels here: {_cpu_kernels.KERNELS.failure}")
    build_dir = os.path.dirname(module.__file__)
    ninja = open(os.path.join(build_dir, "build.ninja")).read()
    assert os.path.join(build_dir, _cpu_kernels.KERNELS.source.name) in ninja
    assert str(_cpu_kernels.KERNELS.source.parent) not in ninja  # the checkout's path is not in the build file


def test_a_finished_build_loads_without_ninja_from_any_venv(monkeypatch):
    """ninja's build file names the venv's torch headers, so going through torch's `load` made every new venv (a
    fresh clone's, CI's second Lightning version) rebuild the kernels (about 75 s here with two workers): a build
    directory that holds the built module is loaded directly."""
    import torch.utils.cpp_extension as cpp_extension

    module = _cpu_kernels.KERNELS.module()
    if module is None:
        pytest.skip(f"no compiled kernels here: {_cpu_kernels.KERNELS.failure}")

    def load(*args, **kwargs):
        raise AssertionError("went through torch's load (ninja) although the build was there")

    monkeypatch.setattr(cpp_extension, "load", load)
    again = _extension.build_extension("ln_lightning_add_norm_cpu", _cpu_kernels.KERNELS.source, "LayerNorm")
    assert again.__file__ == module.__file__


def test_a_build_under_way_or_a_broken_file_goes_through_torch(fake_load, tmp_path, caplog):
    src = tmp_path / "clone" / "k.cpp"
    src.parent.mkdir()
    src.write_text("// v1\n")
    _extension.build_extension("ln_test_kernels", src, "LayerNorm")
    (name, [compiled]), = fake_load
    build_dir = os.path.dirname(compiled)
    assert name == os.path.basename(build_dir)
    with open(os.path.join(build_dir, f"{name}.so"), "wb") as f:
        f.write(b"not a shared object")  # a link cut short
    with caplog.at_level("WARNING"):
        assert _extension.build_extension("ln_test_kernels", src, "LayerNorm") == "module"
    assert len(fake_load) == 2 and "did not load" in caplog.text
    open(os.path.join(build_dir, "lock"), "w").close()  # another process builds: torch's load waits for it
    caplog.clear()
    assert _extension._load_built(name, Path(build_dir)) is None and "did not load" not in caplog.text  # not tried


def test_another_torch_version_gets_its_own_build(fake_load, tmp_path, monkeypatch):
    import torch

    src = tmp_path / "k.cpp"
    src.write_text("// v1\n")
    _extension.build_extension("ln_test_kernels", src, "LayerNorm")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    _extension.build_extension("ln_test_kernels", src, "LayerNorm")
    (n1, _), (n2, _) = fake_load
    assert n1 != n2  # a module built against other headers is never loaded
