"""The package version, kept equal to the project version in the top-level CMakeLists.txt
(tests/python/test_install.py checks that)."""
__version__ = "0.1.0"
