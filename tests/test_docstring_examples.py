"""The examples in attnlang's docstrings run as written (doctest), so the reference a reader
meets in the code cannot drift from it unnoticed."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import attnlang

PACKAGE = Path(attnlang.__file__).parent
# Every module with an example (">>>") in it; none of them needs a GPU or an optional package.
MODULES = sorted(
    "attnlang." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py") if ">>>" in p.read_text())


def test_the_package_has_examples():
    assert "attnlang.codegen.config" in MODULES and len(MODULES) >= 10


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
