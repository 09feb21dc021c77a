"""Every package of the source tree is in the wheel: pyproject lists packages by hand (two live outside the
package directory, ``package-dir``), so a new subpackage left off that list installs nowhere."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {
        "nemo_gym_checkpoint_plugin": ROOT / "nemo_gym_checkpoint_plugin",
        **{name: ROOT / directory for name, directory in config.get("package-dir", {}).items()},
    }
    found = set()
    for name, directory in roots.items():
        for init in directory.rglob("__init__.py"):
            relative = init.parent.relative_to(directory)
            found.add(".".join([name, *relative.parts]))
    return found


def test_every_package_of_the_tree_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert sorted(_source_packages() - listed) == []
    assert sorted(listed - _source_packages()) == []  # and nothing listed that is not there
