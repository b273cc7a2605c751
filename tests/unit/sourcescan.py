"""What the source-scanning tests share: which string constants of a module are docstrings.

Tests that look for a spelling in code (a vLLM metric name, a ``[DONE]`` event, a table rule)
leave docstrings out, since those say what a thing is rather than do it.
"""

from __future__ import annotations

import ast

__all__ = ["docstring_ids"]


def docstring_ids(tree: ast.Module) -> set[int]:
    """``id()`` of each constant in ``tree`` that is a docstring: the first statement of the
    module, a class or a function, when it is a bare constant."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found
