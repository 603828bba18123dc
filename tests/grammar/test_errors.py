"""Error messages: golden files of `file:line:col: error:` output with carets and hints.

Each tests/grammar/errors/NAME.attn has the expected message in NAME.txt. Regenerate after
an intended change with ATTNLANG_UPDATE_GOLDEN=1 and review the diff.
"""

import os
from pathlib import Path

import pytest

import attnlang as al

ERRORS = Path(__file__).parent / "errors"
CASES = sorted(ERRORS.glob("*.attn"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_error_golden(path, monkeypatch):
    monkeypatch.chdir(ERRORS)
    with pytest.raises(al.AttnError) as info:
        al.load(path.name)
    text = str(info.value) + "\n"
    golden = path.with_suffix(".txt")
    if os.environ.get("ATTNLANG_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    # No compiler-internal frame or class name leaks into the message.
    assert "lark" not in text.lower() and "Traceback" not in text


def test_errors_are_sorted_and_collected():
    with pytest.raises(al.AttnErrors) as info:
        al.load(ERRORS / "types.attn")
    errors = info.value.errors
    assert len(errors) >= 6
    positions = [(e.span.line, e.span.col) for e in errors]
    assert positions == sorted(positions)
    assert all(isinstance(e, al.AttnError) for e in errors)


def test_error_positions():
    with pytest.raises(al.AttnErrors) as info:
        al.load(ERRORS / "names.attn")
    by_line = {e.span.line: e for e in info.value.errors}
    assert (by_line[5].span.col, by_line[5].hint) == (30, "did you mean 'cap'?")
    assert isinstance(by_line[5], al.AttnNameError)
    assert by_line[4].hint == "did you mean 'heads'?"
    assert isinstance(by_line[8], al.AttnDeclarationError)


def test_error_kinds():
    with pytest.raises(al.AttnErrors) as info:
        al.load(ERRORS / "scopes.attn")
    assert {type(e) for e in info.value.errors} == {al.AttnScopeError}
    hints = [e.hint for e in info.value.errors]
    assert "'kv_pos' may be used in: key, value, logits, mask" in hints
