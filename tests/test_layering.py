"""The layering rule (docs/style.md): `inference` and `train` import `heads`; `heads` imports
neither; `inference` never imports `train`. Checked on every import statement, lazy ones included."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"heads": {"inference", "train", "commands"}, "inference": {"train", "commands"}}


def imported_subpackages(path: Path, package: str) -> set[tuple[str, int]]:
    """(drafthead subpackage, line) for every import in the file; `package` is the file's own
    dotted package (e.g. drafthead.heads.formats), for resolving relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + ([f"{base}.{a.name}" for a in node.names] if not node.module or node.level else [])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "drafthead" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, layer
    bad = []
    for path in files:
        package = ".".join(["drafthead", *path.relative_to(ROOT).parent.parts])
        for sub, line in imported_subpackages(path, package):
            if sub in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports drafthead.{sub}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from ...train import run\nfrom .. import inference\n")
    found = {sub for sub, _ in imported_subpackages(sample, "drafthead.heads.formats")}
    assert "train" in found
    found = {sub for sub, _ in imported_subpackages(sample, "drafthead.inference")}
    assert "inference" in found
