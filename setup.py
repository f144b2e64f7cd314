# The native helper is a cffi extension in API mode, compiled when the package is installed.
from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
