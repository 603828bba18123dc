"""The wheel ships every subpackage and the non-Python files attnlang reads at run time
(pyproject.toml lists packages by hand: a new subpackage must be added there)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed():
    listed = set(config()["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "attnlang").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages"


@pytest.mark.parametrize("package, directory", [
    ("attnlang.grammar", "attnlang/grammar"),
    ("attnlang.runtime", "attnlang/runtime"),
    ("attnlang.kernels_templates", "kernels_templates"),
])
def test_data_files_are_shipped(package, directory):
    patterns = config()["package-data"].get(package, [])
    data = [p for p in (ROOT / directory).iterdir()
            if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert data, directory
    for path in data:
        assert any(path.match(pattern) for pattern in patterns), (
            f"{path.relative_to(ROOT)} is not in package-data for {package}")
