"""Builds indexer_client with its generated stubs (metadata lives in pyproject.toml).

build_py copies the package and then generates indexer_client/_proto into the build folder
(build_stubs.py); an editable install (pip install -e) generates them beside the sources
instead, where .gitignore keeps them out of git.
"""
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_stubs  # noqa: E402


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        if self.dry_run:
            return
        editable = getattr(self, "editable_mode", False)
        root = Path(__file__).resolve().parent if editable else Path(self.build_lib)
        try:
            build_stubs.generate(root)
        except build_stubs.StubError as e:
            raise SystemExit(f"indexer_client: {e}") from None


setup(cmdclass={"build_py": BuildPyWithStubs})
