"""The exception trees drawn in the docstrings are the classes' own: same classes, same nesting,
same HTTP statuses, same extra (builtin) bases.

The drawings stay hand-written (each line says in words what the error means); this test
generates the tree from the classes and compares it with the drawing, so a class added,
moved or given another status without its line fails here.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

import pytest

from tests.test_import_graph import SHARED, _modules

_LINE = re.compile(r"^(?P<prefix>[│├└─ ]*)(?P<name>[A-Z][A-Za-z0-9]*|\.\.\.)(?: \((?P<bases>[A-Za-z, ]+)\))?(?P<rest>.*)$")


@dataclass(frozen=True, order=True)
class Node:
    path: tuple[str, ...]  # the class's name after its ancestors' in the tree; "..." = drawn elsewhere
    bases: tuple[str, ...]  # builtin bases beside the tree's own parent, as drawn "(ValueError)"
    status: int | None  # the HTTP status drawn on the line (webapp), None when the tree has none


def drawn_tree(docstring: str, marker: str, with_status: bool, dynamic: frozenset[str] = frozenset()) -> list[Node]:
    """The nodes of the block after ``marker`` (the first ``::`` paragraph following it); the
    status of a class in ``dynamic`` (set per instance) is words on its line, not compared."""
    block = docstring.split(marker, 1)[1].split("::\n", 1)[1].splitlines()
    body = [line for line in block[1:] if line.strip()]
    indent = len(body[0]) - len(body[0].lstrip())
    nodes: list[Node] = []
    path: list[str] = []
    for line in block[1:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break  # the paragraph after the drawing
        match = _LINE.match(line[indent:])
        if not match or (match["prefix"] and not match["prefix"].endswith("── ")) or (not match["prefix"] and nodes):
            continue  # a continuation or comment line
        depth = len(match["prefix"]) // 4
        path[depth:] = [match["name"]]
        status = re.search(r"\b([1-5]\d\d)\b", match["rest"]) if with_status and match["name"] not in dynamic else None
        bases = tuple(b.strip() for b in match["bases"].split(",")) if match["bases"] else ()
        nodes.append(Node(tuple(path), bases, int(status[1]) if status else None))
    return sorted(nodes)


def class_tree(root: type, elide: frozenset[type] = frozenset(), with_status: bool = False,
               dynamic: frozenset[str] = frozenset(), above: tuple[str, ...] = ()) -> list[Node]:
    """``root`` and its public subclasses (each under its first base), ``elide``'s subtrees as "..."."""
    path = (*above, root.__name__)
    extra = tuple(b.__name__ for b in root.__bases__[1:] if b.__module__ == "builtins")
    status = root.status if with_status and root.__name__ not in dynamic else None  # type: ignore[attr-defined]
    nodes = [Node(path, extra, status)]
    if root in elide and above:
        return [*nodes, Node((*path, "..."), (), None)]
    for child in root.__subclasses__():
        if not child.__name__.startswith("_") and child.__bases__[0] is root:
            nodes += class_tree(child, elide, with_status, dynamic, path)
    return sorted(nodes)


def _import_all(package: str) -> None:
    for name in sorted(_modules()):
        if name.split(".")[0] == package and "gunicorn.conf" not in name:
            importlib.import_module(name)


def test_the_sdk_tree_is_its_classes():
    from shinken_sync import errors

    _import_all("shinken_sync")
    drawn = drawn_tree(errors.__doc__ or "", "The tree", with_status=False)
    assert drawn[0].path == ("ShinkenError",) and len(drawn) > 20  # the parser read the drawing
    assert drawn == class_tree(errors.ShinkenError)


def test_the_webapp_tree_is_its_classes():
    from webapp import errors, session_errors

    _import_all("webapp")
    dynamic = frozenset({"IpcRemoteError"})  # its status is the worker's answer
    drawn = drawn_tree(errors.__doc__ or "", "with one rule", with_status=True, dynamic=dynamic)
    assert drawn[0].path == ("WebappError",) and len(drawn) > 10  # the parser read the drawing
    assert drawn == class_tree(errors.WebappError, frozenset({session_errors.SessionError}), with_status=True,
                               dynamic=dynamic)
    drawn = drawn_tree(session_errors.__doc__ or "", "Exception tree", with_status=True,
                       dynamic=frozenset({"UpstreamStatus"}))
    assert drawn[0].path == ("SessionError",) and len(drawn) > 20
    assert drawn == class_tree(session_errors.SessionError, frozenset(), with_status=True,
                               dynamic=frozenset({"UpstreamStatus"}))


@pytest.mark.parametrize("package", ["shinken_sync", "webapp"])
def test_every_public_error_class_is_in_its_tree(package):
    """No error class of ours hangs outside its product's root (a caller catches one class).
    The shared layer's (``shinken_sync.childproc``) serve both products; each caller turns them
    into its own tree's (``DaemonStartError``, ``SessionServerNotReady``)."""
    import shinken_sync.errors
    import webapp.errors

    root = {"shinken_sync": shinken_sync.errors.ShinkenError, "webapp": webapp.errors.WebappError}[package]
    _import_all(package)
    outside = []
    for name in sorted(_modules()):
        if name.split(".")[0] != package or "gunicorn.conf" in name or name in SHARED:
            continue
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            value = getattr(module, attr, None)
            is_ours = isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name
            if is_ours and not issubclass(value, root):
                outside.append(f"{name}.{attr}")
    assert outside == []


def test_the_parser_reads_nesting_bases_and_status():
    doc = """x

    Tree::

        Root                 status 500
        ├── A (ValueError)   400  words
        │   │                continued
        │   └── B            413
        └── C                no status here
    """
    assert drawn_tree(doc, "Tree", with_status=True) == sorted([
        Node(("Root",), (), 500), Node(("Root", "A"), ("ValueError",), 400), Node(("Root", "A", "B"), (), 413),
        Node(("Root", "C"), (), None)])


def test_the_class_walk_finds_an_undrawn_class():
    class Root(Exception):
        status = 500

    class Child(Root, KeyError):
        status = 404

    assert class_tree(Root, with_status=True) == [Node(("Root",), (), 500), Node(("Root", "Child"), ("KeyError",), 404)]
