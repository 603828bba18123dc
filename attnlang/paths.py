"""Where attnlang's data files live, the same from a checkout and from an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """The kernel templates: `kernels_templates/` at the top of a checkout, or the
    `attnlang/kernels_templates` subpackage the wheel ships them in."""
    for candidate in (_PKG / "kernels_templates", _PKG.parent / "kernels_templates"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "attnlang's kernel templates are missing: neither "
        f"{_PKG / 'kernels_templates'} nor {_PKG.parent / 'kernels_templates'} holds common.cuh"
    )


def grammar_file() -> Path:
    return _PKG / "grammar" / "attn.lark"
