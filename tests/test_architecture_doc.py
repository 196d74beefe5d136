"""ARCHITECTURE.md stays true to the code: every module, path and dotted name it writes in backticks
exists, its layers table is tests/test_layers.py's ALLOWED table, every package of ours has its
paragraph in "The parts and the flow", and every reference to one of its sections (from the code and
the other documents) names a section or a bold-led paragraph it has."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.test_layers import ALLOWED, layers, our_modules

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
# Our packages, and the two folders of ours that are not installed.
OURS = {*ALLOWED, "bench", "tests"}
# Top-level folders whose backticked paths must exist too.
PATH_ROOTS = OURS | {"deploy", "docs", "config", "bundles"}
# The wire's proto package shares the name of the Python package `specdec` (protos/specdec/v1).
WIRE_PACKAGE = "specdec.v1"


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def code_spans(text: str) -> list[str]:
    """The inline code spans of a markdown text, fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def sections(text: str) -> dict[str, str]:
    """Level-two headings (their numbers dropped) -> the text under them."""
    parts = re.split(r"^## (?:\d+\. )?(.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


# ---- names ----------------------------------------------------------------------------------------


def test_every_path_it_names_exists() -> None:
    missing = []
    for span in code_spans(doc_text()):
        path = span.strip().rstrip(".,:;")
        if "/" not in path or " " in path or "<" in path or path.split("/")[0] not in PATH_ROOTS:
            continue
        found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not found:
            missing.append(path)
    for link in re.findall(r"\]\(([^)#\s]+)[^)]*\)", doc_text()):
        if "://" not in link and not (ROOT / link).exists():
            missing.append(link)
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {sorted(set(missing))}"


def test_every_dotted_name_it_names_exists() -> None:
    """`pkg.module`, `pkg.module.Name` and `pkg.module.Class.attribute`: the module is a file or a
    package of ours, the name is bound at its top level, the attribute in the class."""
    missing = []
    for span in code_spans(doc_text()):
        name = span.strip().split("(")[0]
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name) or name.split(".")[0] not in OURS:
            continue
        if name == WIRE_PACKAGE or name.startswith(WIRE_PACKAGE + "."):
            continue
        if not resolves(name):
            missing.append(name)
    assert not missing, f"ARCHITECTURE.md names modules or names that do not exist: {sorted(set(missing))}"


def test_every_class_attribute_it_names_exists() -> None:
    """`Class.attribute` where Class is a class of ours: some class of that name has the attribute
    (in its body, assigned on self, or in a base class of ours). Names of the wire's messages and
    services are not Python classes of ours and are left to test_protos."""
    classes = class_attributes()
    missing = []
    for span in code_spans(doc_text()):
        name = span.strip().split("(")[0]
        match = re.fullmatch(r"([A-Z]\w*)\.([a-z_]\w*)", name)
        if match and match.group(1) in classes and match.group(2) not in classes[match.group(1)]:
            missing.append(name)
    assert not missing, f"ARCHITECTURE.md names attributes its classes do not have: {sorted(set(missing))}"


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            break
    else:
        return False
    rest = parts[i:]
    if not rest:
        return True
    tree = ast.parse(module.read_text(encoding="utf-8"))
    bound = bound_names(tree.body)
    if rest[0] not in bound:
        return False
    if len(rest) == 1:
        return True
    node = bound[rest[0]]
    if isinstance(node, ast.ClassDef):
        return rest[1] in attributes_of(node)
    return True  # an imported or assigned object: its attributes are not checked


def bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module (or class) body binds, each with the statement that binds it."""
    bound: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        bound[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = node
    return bound


def attributes_of(node: ast.ClassDef) -> set[str]:
    """A class's own attributes: its body's names and what its methods assign on self."""
    names = set(bound_names(node.body))
    for leaf in ast.walk(node):
        if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store) and \
                isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
            names.add(leaf.attr)
    return names


@cache
def class_attributes() -> dict[str, set[str]]:
    """Class name -> the attributes of every class of ours of that name, bases of ours included."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in our_modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                own.setdefault(node.name, set()).update(attributes_of(node))
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                    if isinstance(b, ast.Name | ast.Attribute)
                )

    def with_bases(name: str, seen: frozenset[str]) -> set[str]:
        found = set(own.get(name, ()))
        for base in bases.get(name, ()):
            if base in own and base not in seen:
                found |= with_bases(base, seen | {base})
        return found

    return {name: with_bases(name, frozenset({name})) for name in own}


def test_an_outdated_name_fails() -> None:
    """The checks above catch the names a restructuring retires."""
    assert not resolves("gateway.decode")  # the decoding engine's old home
    assert not (ROOT / "gateway/remote.py").exists()
    assert resolves("gateway.peers.remote.RemoteVerifier") and not resolves("gateway.peers.remote.Peers")
    assert resolves("serving.batching.StepExecutor.run_sync") and not resolves("serving.batching.StepExecutor.nope")


# ---- layers and parts -----------------------------------------------------------------------------


def layers_table() -> dict[str, tuple[str, set[str], str]]:
    """package -> (layer cell, packages in the may-import cell, the may-import cell's text)."""
    rows: dict[str, tuple[str, set[str], str]] = {}
    for line in sections(doc_text())["Layers"].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`"):
            continue
        for package in re.findall(r"`(\w+)/`", cells[1]):
            rows[package] = (cells[0], set(re.findall(r"`(\w+)`", cells[3])), cells[3])
    return rows


def test_the_layers_table_is_the_allowed_table() -> None:
    rows = layers_table()
    assert set(rows) == OURS, f"packages missing from the table or not ours: {set(rows) ^ OURS}"
    layer_of = layers()
    for package, allowed in ALLOWED.items():
        layer, imports, text = rows[package]
        assert imports == allowed, f"{package}: the table says {sorted(imports)}; ALLOWED {sorted(allowed)}"
        assert imports or text == "nothing of ours", f"{package}: {text!r}"
        assert layer == str(layer_of[package]), f"{package}: layer {layer}, by ALLOWED {layer_of[package]}"
    for package in ("bench", "tests"):
        assert rows[package][0] == "—" and rows[package][2] == "anything of ours"


@pytest.mark.parametrize("package", sorted(OURS))
def test_every_package_has_its_paragraph(package: str) -> None:
    parts = sections(doc_text())["The parts and the flow"]
    assert f"**`{package}/`**" in parts, f"no paragraph led by **`{package}/`** in 'The parts and the flow'"


# ---- references to it -----------------------------------------------------------------------------


def references() -> list[tuple[str, str]]:
    """(file, what follows "ARCHITECTURE.md" there, whitespace and comment marks folded) in every
    Python and markdown file of the repository."""
    found = []
    for path in repository_files((".py", ".md")):
        relative = path.relative_to(ROOT)
        text = path.read_text(encoding="utf-8", errors="replace")
        if "ARCHITECTURE.md" not in text:
            continue
        folded = re.sub(r"\n[ \t]*(#[ \t]*)?" if path.suffix == ".py" else r"\n[ \t]*>?[ \t]*", " ", text)
        for match in re.finditer(r"ARCHITECTURE\.md(?:\]\([^)]*\))?", folded):
            found.append((str(relative), folded[match.end():match.end() + 200]))
    return found


def repository_files(suffixes: tuple[str, ...]) -> list[Path]:
    """The repository's files with these suffixes, hidden folders (a virtual environment, caches) and
    node_modules left out without being walked."""
    found: list[Path] = []
    folders = [ROOT]
    while folders:
        for entry in folders.pop().iterdir():
            if entry.name.startswith(".") or entry.name == "node_modules":
                continue
            if entry.is_dir():
                folders.append(entry)
            elif entry.suffix in suffixes:
                found.append(entry)
    return found


def referenced_names(tail: str) -> list[str]:
    names = []
    while match := re.match(r'[,;]\s*"([^"]+)"', tail):
        names.append(match.group(1))
        tail = tail[match.end():]
    return names


def test_references_name_sections_that_exist() -> None:
    """A reference names a section (by its title: numbers move) or a bold-led paragraph."""
    text = doc_text()
    titles = set(sections(text))
    leads = {lead.strip().rstrip(".:") for lead in re.findall(r"\*\*([^*`]+)\*\*", text)}
    wrong = []
    for where, tail in references():
        if re.match(r"[,\s]*sections?\s+\d", tail):
            wrong.append(f"{where}: a section by number ({tail[:30]!r}); name it by its title")
        for name in referenced_names(tail):
            if name not in titles | leads:
                wrong.append(f"{where}: {name!r} is no section or bold-led paragraph of ARCHITECTURE.md")
    assert not wrong, "\n".join(wrong)
