"""The one thing pyproject.toml cannot say: the optional C extension ``common._qkernels``
(one-pass int8/int4 codec kernels, common/_qkernels.c). Where no C compiler is found, the build
skips it (``optional=True``) and common.quant uses its torch implementation of the same format."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("common._qkernels", ["common/_qkernels.c"],
                             extra_compile_args=["-O3", "-ffp-contract=off"], libraries=["m"], optional=True)])
