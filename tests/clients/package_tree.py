"""The client's package as a fresh clone lays it out: clients/python beside proto/, copied from
this working tree without build outputs (so the source tree stays clean and what is tested is
what a clone holds, uncommitted edits included)."""
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_IGNORE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "v1", ".*")


def copy_package(destination):
    """Copies clients/python and proto/ under destination; returns the package directory."""
    package = os.path.join(destination, "clients", "python")
    shutil.copytree(os.path.join(ROOT, "clients", "python"), package, ignore=_IGNORE)
    shutil.copytree(os.path.join(ROOT, "proto"), os.path.join(destination, "proto"))
    return package
