#!/usr/bin/python3
"""Runs the Python client's pytest suite the way a user runs the client: installed.

    run_tests.py ATTNSERVE_BINARY --venv DIR [pytest arguments...]
    run_tests.py ATTNSERVE_BINARY [pytest arguments...]
    run_tests.py ATTNSERVE_BINARY --venv DIR --run SCRIPT [arguments...]

With --venv, installs clients/python (from a fresh-clone copy, see package_tree.py) into DIR, a
venv over Debian's python3 (--system-site-packages: grpcio, protobuf, numpy and pytest come from
apt), with `pip install --no-build-isolation --no-index`, and runs pytest in it. Without, runs
pytest under this python (test_packaging.py installs the package itself). --run runs SCRIPT with
the venv's python instead of pytest, for a test program that uses the installed client
(tests/deploy/proxy_sessions_test.py). ATTNSERVE_BINARY goes to the tests in the environment.
Exits 77 (skipped) when python3-venv, pip, grpcio, protobuf, numpy or pytest is missing.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from package_tree import copy_package  # noqa: E402

SKIP = 77
NEEDED = ("grpc", "google.protobuf", "numpy", "pytest", "venv", "ensurepip", "pip")


def missing_modules():
    missing = []
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def install(venv):
    """The venv's python, with this tree's package freshly installed in it."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(venv) and subprocess.run([python, "-c", ""]).returncode != 0:
        shutil.rmtree(venv)  # left by another python: make it again
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    with tempfile.TemporaryDirectory(prefix="attnserve-package-") as tree:
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-build-isolation",
                        "--no-index", "--force-reinstall", "--no-deps", copy_package(tree)],
                       check=True)
    return python


def main():
    args = sys.argv[1:]
    binary = os.path.abspath(args.pop(0))
    venv = None
    if args[:1] == ["--venv"]:
        venv = os.path.abspath(args[1])
        args = args[2:]
    missing = missing_modules()
    if missing:
        print(f"skipped: {sys.executable} lacks {', '.join(missing)} (deploy/install-deps.sh "
              "installs python3-grpcio python3-protobuf python3-numpy python3-pytest python3-venv "
              "python3-pip)")
        return SKIP
    python = install(venv) if venv else sys.executable
    # No __pycache__ left in the source tree; the installed package, never a source tree.
    env = dict(os.environ, ATTNSERVE_BINARY=binary, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    if args[:1] == ["--run"]:
        return subprocess.run([python, os.path.abspath(args[1]), *args[2:]], env=env).returncode
    # pytest runs in this folder (its rootdir); paths given relative to the caller still work.
    args = [os.path.abspath(a) if os.path.exists(a.split("::")[0]) else a for a in args]
    return subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           *(args or [HERE])], cwd=HERE, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
