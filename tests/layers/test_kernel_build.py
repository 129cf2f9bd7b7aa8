"""Building the native kernels: a build killed partway never blocks a later start; no compiler is one warning.

Each test builds into its own POLYVEC_CACHE in a child process, as a user's first start would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from polyvec.layers import kernels
from tests.conftest import DATA, REPO

needs_build = pytest.mark.skipif(
    kernels._capability() not in kernels.VECTOR_WIDTH, reason="the kernels are built for AVX2/AVX-512 CPUs only"
)
LOAD = "from polyvec.layers import kernels; import sys; sys.exit(0 if kernels.load() else 3)"


def _library(env: dict[str, str]) -> str:
    code = "from polyvec.layers import kernels; print(kernels.library_path())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


@needs_build
def test_build_killed_midway_then_started_again(tmp_path):
    env = {**os.environ, "POLYVEC_CACHE": str(tmp_path)}
    env.pop("POLYVEC_DISABLE_KERNELS", None)
    target = _library(env)
    # Its own session, so the compiler processes it starts can be stopped with it (as Ctrl-C stops a group).
    first = subprocess.Popen(
        [sys.executable, "-c", LOAD], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert first.stderr is not None
    line = first.stderr.readline()
    assert "compiling polyvec's CPU kernels once" in line, line
    time.sleep(4)  # the compiler is running now
    assert first.poll() is None and not os.path.exists(target)
    os.kill(first.pid, signal.SIGKILL)  # the builder itself first: the lock must die with it
    first.wait()
    os.killpg(first.pid, signal.SIGKILL)
    leftovers = os.listdir(os.path.dirname(target))
    assert any(name.startswith("build-") for name in leftovers), leftovers  # it did die partway
    second = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr
    assert "compiled polyvec's CPU kernels" in second.stderr
    assert os.path.isfile(target)
    assert not any(name.startswith("build-") for name in os.listdir(os.path.dirname(target)))
    # A third start loads the cached library without building or waiting.
    start = time.monotonic()
    third = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "compil" not in third.stderr, third.stderr
    assert time.monotonic() - start < 30


def test_library_key_depends_on_the_environment(monkeypatch):
    a = kernels.build_key("AVX512")
    assert kernels.build_key("AVX2") != a
    monkeypatch.setattr(kernels.torch, "__version__", "0.0.0+other")
    assert kernels.build_key("AVX512") != a
    monkeypatch.undo()
    monkeypatch.setattr(kernels.sys.implementation, "cache_tag", "cpython-399")
    assert kernels.build_key("AVX512") != a


def test_no_compiler_is_one_warning_and_the_fallback_runs(tmp_path):
    env = {**os.environ, "POLYVEC_CACHE": str(tmp_path), "CXX": "no-such-c++", "HF_HUB_OFFLINE": "1"}
    env.pop("POLYVEC_DISABLE_KERNELS", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyvec",
            "embed",
            str(DATA / "cranfield" / "corpus.jsonl"),
            "--limit",
            "8",
            "--quiet",
            "--dtype",
            "float32",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "embedded 8 texts" in out.stdout
    if kernels._capability() in kernels.VECTOR_WIDTH:
        warnings = [line for line in out.stderr.splitlines() if "native CPU kernels are not used" in line]
        assert len(warnings) == 1 and "no C++ compiler 'no-such-c++'" in warnings[0], out.stderr
        assert "SDPA" in warnings[0]


FAILING_CXX = """#!/bin/sh
for a in "$@"; do
  case "$a" in -c) echo "fake.cpp:1:1: error: this compiler cannot build it" >&2; exit 1;; esac
done
exec g++ "$@"
"""


@needs_build
def test_a_failed_build_says_why_and_is_not_retried_with_that_compiler(tmp_path):
    """A compiler that cannot build the sources (GCC 10 has no AMX intrinsics): the warning said only "ninja: build
    stopped", and every start spent a minute building again. It names the compiler's error now, and the next
    start with the same compiler falls back at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").write_text(FAILING_CXX)
    (bin_dir / "c++").chmod(0o755)
    env = {**os.environ, "POLYVEC_CACHE": str(tmp_path / "cache"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("POLYVEC_DISABLE_KERNELS", "CXX"):
        env.pop(name, None)
    first = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 3, first.stderr
    assert "error: this compiler cannot build it" in first.stderr and "build-failed.log" in first.stderr
    second = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 3 and "compiling polyvec's CPU kernels" not in second.stderr, second.stderr
    assert "failed before with this compiler" in second.stderr


KILLED_CXX = """#!/bin/sh
for a in "$@"; do
  case "$a" in -c) echo "c++: fatal error: Killed signal terminated program cc1plus" >&2; exit 1;; esac
done
exec g++ "$@"
"""


def _fake_compiler(tmp_path, script: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "c++").write_text(script)
    (bin_dir / "c++").chmod(0o755)
    env = {**os.environ, "POLYVEC_CACHE": str(tmp_path / "cache"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("POLYVEC_DISABLE_KERNELS", "CXX"):
        env.pop(name, None)
    return env


@needs_build
def test_a_build_stopped_from_outside_is_not_kept_as_failed(tmp_path):
    """A compiler killed (out of memory) or a build interrupted is no verdict on the compiler: the next start
    builds again, as the README promises (it was kept as failed for good)."""
    env = _fake_compiler(tmp_path, KILLED_CXX)
    first = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 3 and "Killed signal" in first.stderr, first.stderr
    second = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=600)
    assert "compiling polyvec's CPU kernels" in second.stderr and "failed before" not in second.stderr


@needs_build
def test_processes_waiting_on_a_failing_build_do_not_repeat_it(tmp_path):
    """Replicas or workers started together: one builds, the others wait for its lock; when that build failed,
    each waiter built (and failed) again in turn."""
    env = _fake_compiler(tmp_path, FAILING_CXX.replace("exit 1", "sleep 3; exit 1"))
    runs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, stderr=subprocess.PIPE, text=True)]
    time.sleep(1.5)  # the first holds the lock
    runs.append(subprocess.Popen([sys.executable, "-c", LOAD], env=env, stderr=subprocess.PIPE, text=True))
    errs = [run.communicate(timeout=600)[1] for run in runs]
    assert [run.returncode for run in runs] == [3, 3], errs
    assert "compiling polyvec's CPU kernels once" in errs[0]
    assert "waiting for another process" in errs[1] and "kernels once" not in errs[1], errs[1]
    assert "failed with this compiler" in errs[1]


def test_an_empty_xdg_cache_home_is_unset(monkeypatch, tmp_path):
    """XDG's rule: an empty XDG_CACHE_HOME means the default; it put the cache in the working directory."""
    from polyvec.cache import cache_dir

    monkeypatch.delenv("POLYVEC_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_dir() == tmp_path / ".cache" / "polyvec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "polyvec"


def test_which_failed_builds_are_kept():
    """The toolchain's refusals are kept (a compile error, a linker's or the driver's: collect2's was rebuilt on
    every start); a build stopped from outside is not."""
    for output, kept in (
        ("amx_linear.cpp:12:5: error: '_tile_loadd' was not declared", True),
        ("/usr/bin/ld: cannot find -lgomp\ncollect2: error: ld returned 1 exit status", True),
        ("c++: error: unrecognized command-line option '-mamx-tile'", True),
        ("c++: fatal error: Killed signal terminated program cc1plus", False),
        ("ninja: build stopped: interrupted by user.", False),
        ("fatal error: error writing to /tmp/x.s: No space left on device", False),
    ):
        assert kernels._compile_error(output) is kept, output
