"""The package as users get it: `pip install` into a fresh virtualenv from a fresh-clone layout,
then one attend; a wheel (and an sdist, and a wheel built from that sdist) with Debian's
python3-build. Runs under Debian's /usr/bin/python3 without the package installed."""
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

from package_tree import ROOT, copy_package

ONE_ATTEND = r"""
import sys
import numpy as np
import attnserve, attnserve_client
assert attnserve_client.Client is attnserve.Client
from attnserve.v1 import attention_pb2  # generated at build time
rng = np.random.default_rng(0)
q, k, v = (rng.uniform(-1, 1, s).astype(np.float32) for s in [(1, 5, 2, 16), (1, 7, 1, 16)] * 1
           + [(1, 7, 1, 16)])
with attnserve.Client(sys.argv[1]) as c:
    o = c.attend(q, k, v, causal=True)
s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) / 4.0
s = np.where(np.arange(7)[None, :] <= np.arange(5)[:, None] + 2, s, -np.inf)
p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
want = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v, 2, axis=2))
assert np.abs(o - want).max() < 1e-5, np.abs(o - want).max()
print("attend ok", attnserve.__version__, attnserve.__file__)
"""


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(attnserve VERSION ([0-9.]+)", f.read()).group(1)


def run(*command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_fresh_venv_install_then_attend(server, tmp_path):
    package = copy_package(str(tmp_path / "clone"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", str(venv))
    pip = str(venv / "bin" / "pip")
    run(pip, "install", "--no-build-isolation", "--no-index", package)
    out = run(str(venv / "bin" / "python"), "-c", ONE_ATTEND, server.target, cwd=str(tmp_path),
              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "attend ok" in out and str(venv) in out  # the installed copy, not a source tree
    show = run(pip, "show", "attnserve")
    assert f"Version: {project_version()}" in show  # one version for the project
    # The build wrote nothing the source tree would have to ignore besides its own outputs.
    generated = os.path.join(package, "attnserve", "v1")
    assert not os.path.exists(generated), "a regular install must not generate into the source"


@pytest.fixture(scope="module")
def build_module():
    if importlib.util.find_spec("build") is None:
        pytest.skip("python3-build is not installed (deploy/install-deps.sh installs it)")


def wheel_names(path):
    with zipfile.ZipFile(path) as z:
        return set(z.namelist())


def test_wheel_with_python3_build(build_module, tmp_path):
    package = copy_package(str(tmp_path / "clone"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(dist),
        package)
    wheels = list(dist.glob("attnserve-*.whl"))
    assert len(wheels) == 1 and f"-{project_version()}-" in wheels[0].name
    names = wheel_names(wheels[0])
    for needed in ("attnserve/__init__.py", "attnserve/v1/__init__.py",
                   "attnserve/v1/attention_pb2.py", "attnserve/py.typed",
                   "attnserve_client/__init__.py"):
        assert needed in names, f"{needed} not in {sorted(names)}"
    assert not any("_pb2" in n for n in names if not n.startswith("attnserve/v1/"))


def test_sdist_carries_the_protos_and_builds_a_wheel(build_module, tmp_path):
    """Without flags, build makes an sdist and then the wheel from that sdist alone, where
    ../../proto does not exist: the protos must travel in the sdist."""
    package = copy_package(str(tmp_path / "clone"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), package)
    sdist, = dist.glob("attnserve-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = t.getnames()
    assert any(n.endswith("/proto/attnserve/v1/attention.proto") for n in names), names
    assert not any("_pb2" in n for n in names), "generated code must not be in the sdist"
    wheel, = dist.glob("attnserve-*.whl")
    assert "attnserve/v1/attention_pb2.py" in wheel_names(wheel)


def test_no_generated_code_is_committed():
    try:
        tracked = subprocess.run(["git", "ls-files", "clients/python"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert not [f for f in tracked if "_pb2" in f]
