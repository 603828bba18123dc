"""One error family for every mistake in an .attn file, and its one formatter.

Each error carries a Span; `str(err)` renders it the way compilers do::

    softcap.attn:7:20: error: unknown name 'cpa'
      logits = cap * tanh(logits / cpa)
                                   ^^^
    hint: did you mean 'cap'?

Several errors of one file travel together as an `AttnErrors` (itself an AttnError), sorted
by position. Lark's exceptions never reach users: the parser converts them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = [
    "Span", "AttnError", "AttnSyntaxError", "AttnNameError", "AttnScopeError",
    "AttnTypeError", "AttnDeclarationError", "AttnErrors", "did_you_mean",
]


@dataclass(frozen=True)
class Span:
    """A source range, 1-based lines and columns; end is exclusive (end_col may equal col+1)."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class AttnError(Exception):
    """A mistake in an attention variant's source, located by `span`."""

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None,
                 source: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint
        self.source = source

    @property
    def errors(self) -> list[AttnError]:
        return [self]

    def __str__(self) -> str:
        return format_error(self)


class AttnSyntaxError(AttnError):
    """The text does not follow the grammar."""


class AttnNameError(AttnError):
    """An unknown or redeclared name."""


class AttnScopeError(AttnError):
    """A name used in a stage that cannot see it."""


class AttnTypeError(AttnError):
    """An expression of the wrong type, or a call with the wrong arguments."""


class AttnDeclarationError(AttnError):
    """A malformed declaration: a duplicated stage, a bad extent, a non-constant const."""


class AttnErrors(AttnError):
    """Several errors found in one pass over a file, sorted by position."""

    def __init__(self, errors: list[AttnError]):
        ordered = sorted(errors, key=_position)
        super().__init__(ordered[0].message, ordered[0].span, ordered[0].hint, ordered[0].source)
        self._errors = ordered

    @property
    def errors(self) -> list[AttnError]:
        return list(self._errors)

    def __str__(self) -> str:
        text = "\n".join(format_error(e) for e in self._errors)
        n = len(self._errors)
        return f"{text}\n{n} error{'s' if n > 1 else ''} found"


def _position(e: AttnError) -> tuple[int, int]:
    return (e.span.line, e.span.col) if e.span else (0, 0)


def format_error(e: AttnError) -> str:
    """`file:line:col: error: message`, the source line, a caret run, and `hint:` if any."""
    if e.span is None:
        head = f"error: {e.message}"
        return head + (f"\nhint: {e.hint}" if e.hint else "")
    lines = [f"{e.span}: error: {e.message}"]
    if e.source is not None:
        # Lines end at "\n" only, as the lexer counts them (splitlines would also split at
        # \f, \v or U+2028 and show the wrong line).
        src_lines = e.source.split("\n")
        if 1 <= e.span.line <= len(src_lines):
            text = src_lines[e.span.line - 1].rstrip("\r")
            end = e.span.end_col if e.span.end_line == e.span.line else len(text) + 1
            width = max(1, min(end, len(text) + 1) - e.span.col)
            # Tabs stay tabs under the caret, so it lines up however a terminal expands them.
            pad = "".join(c if c == "\t" else " " for c in text[:e.span.col - 1])
            lines.append(f"  {text}")
            lines.append("  " + pad + "^" * width)
    if e.hint:
        lines.append(f"hint: {e.hint}")
    return "\n".join(lines)


def did_you_mean(name: str, candidates) -> str | None:
    """A 'did you mean ...?' hint for a misspelt name, or None if nothing is close."""
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
