"""The wheel: built from the repository's files, installed into a fresh virtual environment, imported.

The environment reuses the running interpreter's packages (a .pth file lists its site-packages:
torch and triton are not downloaded again) and gets the wheel with --no-deps, so what is checked is
the wheel itself: its
files against the source tree (data files included), its declared dependencies, and that the
installed package imports, computes attention and runs its command. pip builds the wheel as
`pip install` would (setuptools in an isolated build environment). Also: CI runs the README's test
command, and the README's demo set-up brings the demo's optional dependencies.
"""

import email
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# What `pip install flashtile` brings, with no upper bounds that would move a user's installs
CORE = {"torch", "triton", "numpy", "packaging"}
EXTRAS = {"interpret", "test", "bench", "hf"}


def _source_files() -> list[str]:
    """The files a wheel is built from: the repository's (git's list in a clone), else the tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", "README.md", "src"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        files = [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        files = ["pyproject.toml", "README.md"] + [
            str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)]
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built by pip from a copy of the source files (a build writes build/ and egg-info
    next to the sources: not in the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for f in _source_files():
        (tmp / "src" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tmp / "src" / f)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp / "dist"),
                             str(tmp / "src")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (tmp / "dist").glob("flashtile-*.whl")
    return built


def test_wheel_holds_every_package_file(wheel):
    in_tree = {f[len("src/"):] for f in _source_files() if f.startswith("src/flashtile/")}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if n.startswith("flashtile/")}
    assert not in_tree - in_wheel, f"files of the package missing from the wheel: {sorted(in_tree - in_wheel)}"
    assert not in_wheel - in_tree, f"files in the wheel that the repository does not hold: {sorted(in_wheel - in_tree)}"
    assert any(not f.endswith(".py") for f in in_tree), "no data file in the tree: this test would not see one drop"


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_wheel_dependencies(wheel):
    meta = _metadata(wheel)
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    core = {r.name: r for r in requires if r.marker is None}
    assert set(core) == CORE
    assert all(not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier) for r in core.values()), \
        f"an upper bound in the core dependencies: {[str(r) for r in core.values()]}"
    assert set(meta.get_all("Provides-Extra")) == EXTRAS

    def extra(r):
        return next(e for e in EXTRAS if r.marker.evaluate({"extra": e}))

    optional = {(r.name, extra(r)): r for r in requires if r.marker is not None}
    assert ("tqdm", "bench") in optional and ("matplotlib", "bench") in optional
    assert str(optional[("numpy", "interpret")].specifier) == "<2.3"
    assert ("transformers", "hf") in optional


def _package_dirs() -> list[str]:
    """Where the running interpreter's packages are: its site-packages (a venv's own, a conda
    prefix's, the system's) and the user site when that is on the path. `venv
    --system-site-packages` would give the base interpreter's instead, which inside a venv does
    not hold torch."""
    paths = site.getsitepackages() + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    if site.ENABLE_USER_SITE and site.getusersitepackages() in sys.path:
        paths.append(site.getusersitepackages())
    return [p for p in dict.fromkeys(paths) if os.path.isdir(p)]


def test_wheel_installs_and_imports(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # the running interpreter's packages as plain path entries after the venv's own: a .pth file's
    # lines are not read for .pth files of their own, so this environment's editable install of
    # flashtile (a .pth finder) does not come along
    (Path(purelib) / "_running_python.pth").write_text("\n".join(_package_dirs()) + "\n")
    # neither the repository on PYTHONPATH nor an install of it in the system site-packages may
    # stand in for the wheel: pip would take either as flashtile already installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    result = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet",
                             str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    code = f"""
import importlib, pkgutil, sys
import torch, flashtile
assert flashtile.__file__.startswith({str(venv)!r}), flashtile.__file__   # the wheel, not the repository
for m in pkgutil.walk_packages(flashtile.__path__, "flashtile."):
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:  # an optional library this environment lacks is fine
        if e.name.split(".")[0] == "flashtile":
            raise
q, k, v = torch.randn(3, 1, 37, 4, 16).unbind(0)
out = flashtile.flash_attn_func(q, k, v, causal=True)
from flashtile.reference import naive
ref, _ = naive.attention(q, k, v, causal=True, compute_dtype=torch.float64)
torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-6)
"""
    result = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([str(bin_dir / "flashtile"), "--help"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0 and "demo" in result.stdout, result.stdout + result.stderr


def _readme_command(marker: str) -> str:
    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines()
               if marker in line and "pip install" in line]
    return line.strip()


def test_ci_runs_the_readme_test_command():
    assert _readme_command("python -m pytest") in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_demo_command_installs_the_demo_dependencies(wheel):
    """The demo draws its progress bar with tqdm, which is optional: the set-up line must bring it."""
    command = _readme_command("flashtile demo")
    extras = command.split('-e ".[', 1)[1].split("]", 1)[0].split(",")
    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist")]
    assert any(r.name == "tqdm" and r.marker is not None and any(r.marker.evaluate({"extra": e}) for e in extras)
               for r in requires), command
