#!/usr/bin/python3
"""Installs client/python with pip, as `pip install ./client/python` does, into a folder.

The CMake build runs it to put the package into <build>/python, where the Python tests import
it from (PYTHONPATH=<build>/python); test_install.py uses its functions for a fresh venv.
pip builds from a clean copy of client/python and proto/ (in a temporary folder), so the source
tree gets no build/ or *.egg-info folders and two builds never share one.

  install_package.py SOURCE_ROOT TARGET_DIR   (offline: --no-deps --no-build-isolation --no-index)
PROTOC and GRPC_PYTHON_PLUGIN in the environment choose the code generators (build_stubs.py).
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

PIP_OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
               "--disable-pip-version-check", "--quiet"]
_LEFT_BY_BUILDS = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "_proto", "*.pyc")


def copy_sources(source_root: str, dest_root: str) -> str:
    """Copies client/python and proto/ into dest_root (same layout); returns the package dir."""
    package = os.path.join(dest_root, "client", "python")
    shutil.copytree(os.path.join(source_root, "client", "python"), package, ignore=_LEFT_BY_BUILDS)
    shutil.copytree(os.path.join(source_root, "proto"), os.path.join(dest_root, "proto"),
                    ignore=shutil.ignore_patterns("CMakeLists.txt"))
    return package


def pip_install(python: str, package_dir: str, extra=()) -> None:
    """`python -m pip install` of package_dir, offline; raises CalledProcessError with pip's
    output on failure."""
    run = subprocess.run([python, "-m", "pip", "install", *PIP_OFFLINE, *extra, package_dir],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise subprocess.CalledProcessError(run.returncode, run.args, run.stdout, run.stderr)


def install_into(source_root: str, target: str) -> None:
    """Installs the package into `target` (pip --target), replacing an earlier install."""
    os.makedirs(target, exist_ok=True)
    for old in [os.path.join(target, "indexer_client")] + \
            glob.glob(os.path.join(target, "indexer_client-*.dist-info")):
        shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="indexer-py-build-") as tmp:
        package = copy_sources(source_root, tmp)
        pip_install(sys.executable, package, ["--target", target])


def main(argv) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} SOURCE_ROOT TARGET_DIR", file=sys.stderr)
        return 2
    try:
        install_into(argv[1], argv[2])
    except subprocess.CalledProcessError as e:
        print(f"install_package: pip failed (exit {e.returncode}):\n{e.stdout}{e.stderr}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
