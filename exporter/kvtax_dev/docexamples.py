"""The docstrings' examples and references, checked against the code they describe.

A docstring shows code two ways. A doctest (``>>>`` lines and what they print) runs as it is:
``tests/unit/test_docstring_examples.py`` runs every one in the package. An ``Example::`` block
sketches what needs a server, a socket or a running loop, which a doctest cannot hold; it cannot
run, so :func:`problems` checks it the way a reader would rely on it: it is Python (``await``,
``async with`` and ``return`` allowed, ``...`` for what is left out), every function or class it
calls exists (in the module, among the builtins, or imported by the example), and every call
passes arguments the callee takes, positional and keyword, read from the real signature; a
method called on an object the example made from a class must exist on that class and take
those arguments. A name that resolves nowhere (``body``, ``request``, ``clock()``) is taken for
the reader's own and not checked, and so are the methods of objects whose type the example
does not show.

:func:`problems` also resolves every Sphinx reference of a docstring (a ``func``, ``class``,
``mod``, ``meth``, ``attr``, ``data``, ``exc`` or ``obj`` role, relative names included, as
Sphinx looks them up): a name that no longer exists sends the reader nowhere.

Example::

    import kvtax.gate.order
    for problem in problems(kvtax.gate.order):
        print(problem)
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["Block", "block_problems", "blocks", "problems", "reference_problems"]

# An example block's introduction: "Example::", "Example (what vLLM does)::", "Usage::".
_INTRO = re.compile(r"^(?:Example|Examples|Usage)\b.*::$")
_ROLE = re.compile(r":(func|class|mod|meth|data|attr|exc|obj):`([^`]+)`")


@dataclass(frozen=True, slots=True)
class Block:
    """One ``Example::`` block of a docstring that holds no doctest."""

    where: str  # "module.qualname"
    code: str
    line: int  # of the docstring, in the module's file


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, ast.AST, str]]:
    """(qualified name, node, docstring) of the module and each class and function in it."""
    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc:
        yield "", tree, module_doc

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    yield name, child, doc
                yield from walk(child, name + ".")

    yield from walk(tree, "")


def _source(module: ModuleType) -> str:
    path = inspect.getsourcefile(module)
    return Path(path).read_text(encoding="utf-8") if path else ""


def blocks(module: ModuleType, source: str | None = None) -> list[Block]:
    """Every example block of ``module``'s docstrings that is not a doctest (read from its file,
    or from ``source``)."""
    out = []
    for qualname, node, doc in _docstrings(
        ast.parse(_source(module) if source is None else source)
    ):
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if not _INTRO.match(line.strip()):
                continue
            body: list[str] = []
            for text in lines[i + 1 :]:
                if text.strip() and not text.startswith((" ", "\t")):
                    break
                body.append(text)
            code = textwrap.dedent("\n".join(body)).strip("\n")
            if code and ">>>" not in code:
                where = f"{module.__name__}{'.' if qualname else ''}{qualname}"
                out.append(Block(where, code, getattr(node, "lineno", 1)))
    return out


# -- an example block's calls -------------------------------------------------------------------


class _Instance:
    """What an example name holds when the example made it from a class: that class's object."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


class _Checker(ast.NodeVisitor):
    def __init__(self, module: ModuleType, block: Block) -> None:
        self.module = module
        self.block = block
        self.names: dict[str, Any] = {}  # example name -> object, _Instance, or None (unknown)
        self.found: list[str] = []

    # The example's own names.
    def _bind(self, target: ast.AST, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.names[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._bind(element, None)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        made = self._made(node.value)
        for target in node.targets:
            self._bind(target, made)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, self._made(node.value))

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self._bind(node.target, None)
        for statement in (*node.body, *node.orelse):
            self.visit(statement)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self._bind(item.optional_vars, self._made(item.context_expr))
        for statement in node.body:
            self.visit(statement)

    visit_AsyncWith = visit_With

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            try:
                if isinstance(node, ast.ImportFrom):
                    value = getattr(importlib.import_module(node.module or ""), alias.name)
                else:
                    # "import a.b" binds a; "import a.b as c" binds a.b.
                    imported = importlib.import_module(alias.name)
                    value = (
                        imported
                        if alias.asname
                        else importlib.import_module(alias.name.split(".")[0])
                    )
            except ModuleNotFoundError as exc:
                # What needs a package this environment lacks (vLLM, for the plugin) cannot be
                # checked here; a kvtax module that is gone can.
                if (exc.name or "").split(".")[0] in {"kvtax", "kvtax_dev"}:
                    self._report(f"imports {alias.name}, which cannot be imported")
                value = None
            except (ImportError, AttributeError):
                self._report(f"imports {alias.name}, which cannot be imported")
                value = None
            self.names[(alias.asname or alias.name).split(".")[0]] = value

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.names[node.name] = None
        for statement in node.body:
            self.visit(statement)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        # Its parameters are its own names; what it calls is checked like any call.
        for argument in node.args.args:
            self.names[argument.arg] = None
        self.visit(node.body)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.visit(node.iter)
        self._bind(node.target, None)
        for condition in node.ifs:
            self.visit(condition)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        for generator in node.generators:
            self.visit_comprehension(generator)
        self.visit(node.elt)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = _comprehension

    # What a name or attribute holds.
    def _value(self, node: ast.AST) -> tuple[bool, Any]:
        """(known, value) of an expression the example calls or reads an attribute of."""
        if isinstance(node, ast.Name):
            if node.id in self.names:
                value = self.names[node.id]
                return value is not None, value
            if node.id in vars(self.module):
                return True, vars(self.module)[node.id]
            if hasattr(builtins, node.id):
                return True, getattr(builtins, node.id)
            return False, None
        if isinstance(node, ast.Attribute):
            # A call's result, when the call says its class: Cls(...).method().
            made = self._made(node.value) if isinstance(node.value, ast.Call) else None
            known, base = (True, made) if made is not None else self._value(node.value)
            if not known:
                return False, None
            owner = base.cls if isinstance(base, _Instance) else base
            if _has(owner, node.attr, instance=isinstance(base, _Instance)):
                attr = inspect.getattr_static(owner, node.attr, None)
                if attr is None or (isinstance(base, _Instance) and not callable(attr)):
                    return False, None  # an instance's field: its type is not shown
                return True, getattr(owner, node.attr)
            where = owner.__name__ if hasattr(owner, "__name__") else type(owner).__name__
            self._report(f"uses {where}.{node.attr}, which does not exist")
            return False, None
        return False, None

    def _made(self, node: ast.AST) -> Any:
        """What ``node`` makes, when it calls a class (or a function that says its class)."""
        if isinstance(node, ast.Await):
            node = node.value
        if not isinstance(node, ast.Call):
            return None
        known, callee = self._value(node.func)
        if not known:
            return None
        if isinstance(callee, type):
            return _Instance(callee)
        try:
            made = typing.get_type_hints(callee).get("return")
        except (NameError, TypeError, AttributeError):  # a hint it cannot read tells nothing
            return None
        return _Instance(made) if isinstance(made, type) and made is not type(None) else None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._value(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        # A name that resolves nowhere is the reader's own (clock(), body), not checked.
        known, callee = self._value(node.func)
        if not known:
            return
        base = self._base(node.func.value) if isinstance(node.func, ast.Attribute) else None
        # A method called on an instance takes the instance first; a static method does not.
        bound = isinstance(base, _Instance) and not isinstance(
            inspect.getattr_static(base.cls, getattr(node.func, "attr", ""), None),
            staticmethod | classmethod,
        )
        self._check_call(node, callee, bound=bound)

    def _base(self, node: ast.AST) -> Any:
        """What the object a method is called on holds, without reporting anything twice."""
        found = list(self.found)
        value = self._made(node) if isinstance(node, ast.Call) else self._value(node)[1]
        self.found = found
        return value

    def _check_call(self, node: ast.Call, callee: Any, *, bound: bool) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            return  # *args or **kwargs: nothing to count
        if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in node.args):
            return  # Panel(...): the arguments are left out on purpose
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):
            return  # a builtin without a signature
        args = [object()] * (len(node.args) + (1 if bound else 0))
        kwargs = {k.arg: object() for k in node.keywords if k.arg is not None}
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            name = getattr(callee, "__qualname__", repr(callee))
            self._report(f"calls {name}{signature} wrongly: {exc}")

    def _report(self, message: str) -> None:
        # A call's callee is read twice (visiting the call, then checking it): report once.
        problem = f"{self.block.where}: the example {message}"
        if problem not in self.found:
            self.found.append(problem)


def _has(owner: Any, attr: str, *, instance: bool) -> bool:
    if hasattr(owner, attr):
        return True
    if not instance or not isinstance(owner, type):
        return False
    # An instance attribute: a dataclass field, a slot, an annotation, or set in __init__.
    if attr in getattr(owner, "__dataclass_fields__", {}):
        return True
    for cls in owner.__mro__:
        if attr in getattr(cls, "__slots__", ()) or attr in getattr(cls, "__annotations__", {}):
            return True
        init = vars(cls).get("__init__")
        if init is not None:
            try:
                if re.search(rf"\bself\.{re.escape(attr)}\b\s*[:=]", inspect.getsource(init)):
                    return True
            except (OSError, TypeError):
                pass
    return False


def _parse(code: str) -> ast.Module:
    """The example as one function body, so that await, async with and return are Python."""
    wrapped = "async def _example():\n" + textwrap.indent(code, "    ")
    return ast.parse(wrapped)


def block_problems(module: ModuleType, block: Block) -> list[str]:
    """What is wrong with one example block of ``module``."""
    try:
        tree = _parse(block.code)
    except SyntaxError as exc:
        return [f"{block.where}: the example is not Python: {exc.msg} in {exc.text!r}"]
    checker = _Checker(module, block)
    function = tree.body[0]
    assert isinstance(function, ast.AsyncFunctionDef)
    for statement in function.body:
        checker.visit(statement)
    return checker.found


# -- references -----------------------------------------------------------------------------


def _resolve(module: ModuleType, target: str, role: str, owners: list[Any]) -> bool:
    """Whether a reference of ``role`` to ``target`` names something, as Sphinx would look:
    in the docstring's own class first (``owners``, innermost first), then the module, then
    the package, then as a full dotted name. A method or attribute named bare in a module's
    docstring may belong to any of its classes."""
    target = " ".join(target.split()).replace(" ", "").lstrip("~").removesuffix("()")
    head = target.split(".")[0]
    for owner in owners:
        if hasattr(owner, head) or _has(owner, head, instance=True):
            return True
    if role in {"meth", "attr"} and "." not in target:
        classes = [v for v in vars(module).values() if isinstance(v, type)]
        if any(_has(cls, target, instance=True) for cls in classes):
            return True
    if target.startswith("."):
        package = module.__name__ if hasattr(module, "__path__") else module.__package__ or ""
        stripped = target.lstrip(".")
        up = len(target) - len(stripped) - 1
        base = package.rsplit(".", up)[0] if up else package
        candidates = [f"{base}.{stripped}", f"{module.__name__}.{stripped}"]
    else:
        candidates = [f"{module.__name__}.{target}", target]
        if module.__package__:
            candidates.append(f"{module.__package__}.{target}")
    return any(_importable(c) for c in candidates) or _in_module(module, target)


def _in_module(module: ModuleType, target: str) -> bool:
    head, *rest = target.split(".")
    namespace = vars(module)
    if head in namespace:
        value = namespace[head]
    elif hasattr(builtins, head):
        value = getattr(builtins, head)
    else:
        return False
    for part in rest:
        if not (hasattr(value, part) or _has(value, part, instance=True)):
            return False
        value = getattr(value, part, None)
    return True


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            try:
                if not (hasattr(value, part) or _has(value, part, instance=True)):
                    return False
                value = getattr(value, part, None)
            except ImportError:
                # A name the module builds on first use from a dependency absent here (the
                # test bed's scheduler probe subclasses vLLM's stat logger): it exists.
                return True
        return True
    return False


def reference_problems(module: ModuleType, source: str | None = None) -> list[str]:
    """Every Sphinx reference of ``module``'s docstrings (in its file, or in ``source``) that
    names nothing."""
    out = []
    for qualname, _, doc in _docstrings(ast.parse(_source(module) if source is None else source)):
        where = f"{module.__name__}{'.' if qualname else ''}{qualname}"
        for role, target in _ROLE.findall(doc):
            name = target.split("<")[-1].rstrip(">") if "<" in target else target
            if not _resolve(module, name.strip(), role, _owners(module, qualname)):
                out.append(f"{where}: :{role}:`{' '.join(target.split())}` names nothing")
    return out


def _owners(module: ModuleType, qualname: str) -> list[Any]:
    """The classes (and functions) a docstring sits in, innermost first."""
    owners: list[Any] = []
    value: Any = module
    for part in qualname.split(".") if qualname else ():
        value = getattr(value, part, None)
        if value is None:
            break
        owners.append(value)
    return [o for o in reversed(owners) if isinstance(o, type)]


def problems(module: ModuleType) -> list[str]:
    """Everything wrong with ``module``'s example blocks and docstring references."""
    found = [p for block in blocks(module) for p in block_problems(module, block)]
    return found + reference_problems(module)
