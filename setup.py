"""Packages by discovery. The core library is ``rlreplay/``; ``cli/``, ``recorders/`` and
``uploaders/`` install as ``rlreplay.cli``, ``rlreplay.recorders`` and ``rlreplay.uploaders``.
``[tool.setuptools.packages.find]`` cannot name a folder's packages under another name, so each
folder's packages are found here and prefixed; everything else is in ``pyproject.toml``.
``tests/test_wheel.py`` builds the wheel and checks that every package and data file is in it."""

from setuptools import find_packages, setup

#: Installed package -> the folder it is read from.
PACKAGE_DIR = {
    "rlreplay": "rlreplay",
    "rlreplay.cli": "cli",
    "rlreplay.recorders": "recorders",
    "rlreplay.uploaders": "uploaders",
}


def discovered_packages() -> list[str]:
    """Every package under each folder of ``PACKAGE_DIR``, named under its installed name."""
    packages = []
    for name, folder in PACKAGE_DIR.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return sorted(set(packages))


setup(packages=discovered_packages(), package_dir=PACKAGE_DIR)
