"""The one compiled part: hibernate/store/_bulk.c (see hibernate/store/bulk.py).

Optional: where no C compiler is present the install goes on without it, and
hibernate runs the same functions in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hibernate.store._bulk", ["hibernate/store/_bulk.c"], optional=True)])
