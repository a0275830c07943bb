"""Every repository path the project names in its own text exists, and no file cites a document that is
not in the repository (pure text scanning, no imports).

Scanned: every source file of the project folders (.py, .sh, .yaml, .md, .json next to the code), conf/,
the Makefile, README.md, ARCHITECTURE.md and docs/*.md. A path is a token that starts with one of the
repository's own top-level folders (`eagle3/ttt/loss.py`, `docs/study/`, `conf/target/*.yaml`); a
placeholder (`<stage>`, `*`, `NNN`) matches as a glob. `eagle3/replay/cost_model.PRESETS` names
eagle3/replay/cost_model.py, and a dotted name under eagle3 names a module and a name it defines.
What is not read as a repository path: absolute paths and paths under a run's directory (`/data/x`,
`runs/.../train/`), a name with neither an extension nor a trailing slash outside eagle3/ and docs/
(`train/validation` is a pair of splits, `eval/acc_step0` a metric), and, in tests/, paths outside eagle3/
and docs/ (tests build stage layouts of their own in temporary directories).
"""
from __future__ import annotations

import re
from pathlib import Path

from eagle3 import REPO_ROOT

TOP = ("eagle3", "data", "train", "eval", "export", "pipeline", "tests", "benchmarks", "conf", "docs", ".ci")
SOURCE_FOLDERS = ("eagle3", "data", "train", "eval", "export", "pipeline", "tests", "benchmarks", "conf", ".ci")
SOURCE_SUFFIXES = {".py", ".sh", ".yaml", ".md", ""}
# a file extension that ends a path; anything else after a dot is a name inside a module (`cost_model.PRESETS`)
EXTENSIONS = {"py", "md", "yaml", "yml", "json", "jsonl", "sh", "txt", "png", "toml", "safetensors", "csv", "pt", "cfg"}
# the documents the project itself keeps at its root (a bare name elsewhere is a citation of a file not here)
ROOT_DOCS = ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "RELIABILITY.md")
# documents the stages write into their output, not kept in the repository
WRITTEN_DOCS = ("SERVE.md",)
CODE_ROOTS = ("eagle3", "docs")

# not preceded by a path or word character (an absolute /data/x or runs/.../train/ is no repository path)
PATH = re.compile(r"(?<![\w/.$<{~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*<>{}-]*)")
DOTTED = re.compile(r"(?<![\w./-])(eagle3(?:\.[A-Za-z_]\w*)+)")
CITED_MD = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")
OUTSIDE = re.compile(r"(?<![\w.])(\.\./[\w./-]+)")  # a relative path that leaves the repository
DESIGN_SECTION = re.compile(r'docs/design\.md`?,? "([^"]+)"')


DESIGN = (REPO_ROOT / "docs" / "design.md").read_text()


def scanned_files() -> list[Path]:
    files = [REPO_ROOT / n for n in ("README.md", "ARCHITECTURE.md", "Makefile")]
    files += sorted((REPO_ROOT / "docs").glob("*.md"))
    for folder in SOURCE_FOLDERS:
        for p in sorted((REPO_ROOT / folder).rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts \
                    and not (p.suffix == "" and p.parent.name != ".ci"):
                files.append(p)
    return [f for f in files if f != Path(__file__).resolve()]  # its own planted stale paths


def _exists(path: str) -> bool:
    """A repository path exists: a file, a folder, a glob with a match, or a module followed by a name."""
    path = path.rstrip(".,;:)")
    if re.search(r"[<*{]|N{3,}", path):
        pattern = re.sub(r"<[^>]*>|\{[^}]*\}|N{3,}", "*", path)
        return any(REPO_ROOT.glob(pattern.rstrip("/")))
    if (REPO_ROOT / path).exists():
        return True
    stem, dot, rest = path.rpartition("/")[2].partition(".")
    if dot and rest.split(".")[0] not in EXTENSIONS:  # module.Name -> module.py
        return (REPO_ROOT / path).parent.joinpath(stem + ".py").exists()
    return False


def _module_exists(dotted: str) -> bool:
    """The longest module prefix of `dotted` exists, and the name after it (if any) is defined there."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO_ROOT.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if source.exists():
            if i == len(parts):
                return True
            name = re.escape(parts[i])
            return re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from|import)\s.*\b{name}\b",
                             source.read_text(), re.M) is not None
    return False


def missing_paths(files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        rel = f.relative_to(REPO_ROOT) if f.is_relative_to(REPO_ROOT) else Path(f.name)
        in_tests = rel.parts[0] == "tests"
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in PATH.finditer(line):
                token = m.group(1).rstrip(".,;:)")
                top = token.split("/")[0]
                if top not in CODE_ROOTS and (in_tests or ("." not in token and not token.endswith("/"))):
                    continue
                if token.rstrip("/") in TOP or _exists(token):
                    continue
                bad.append(f"{rel}:{n}: {token}")
            for m in DOTTED.finditer(line):
                if not _module_exists(m.group(1)):
                    bad.append(f"{rel}:{n}: {m.group(1)}")
            for m in OUTSIDE.finditer(line):
                # fine when read from the file's folder or from a top-level folder (Hydra's `config_path="../conf"`)
                token = m.group(1).rstrip(".,;:)")
                if not any((base / token).resolve().is_relative_to(REPO_ROOT) and (base / token).exists()
                           for base in (REPO_ROOT / rel.parent, REPO_ROOT / "eagle3")):
                    bad.append(f"{rel}:{n}: {token} (outside the repository)")
            for m in DESIGN_SECTION.finditer(line):
                if f"\n## {m.group(1)}\n" not in DESIGN:
                    bad.append(f"{rel}:{n}: docs/design.md has no section {m.group(1)!r}")
            for m in CITED_MD.finditer(line):
                if m.group(1) not in ROOT_DOCS + WRITTEN_DOCS and not any(REPO_ROOT.rglob(m.group(1))):
                    bad.append(f"{rel}:{n}: {m.group(1)} (not in the repository)")
    return bad


def test_every_named_repository_path_exists():
    bad = missing_paths(scanned_files())
    assert not bad, "paths named in the project's text that do not exist (moved? renamed?):\n" + "\n".join(bad)


def test_the_scan_finds_a_stale_path(tmp_path):
    """Not vacuous: a moved module, a module named by its pre-move layout, a dotted module, a citation of a
    document not in the repository, a glob with no match, a section docs/design.md lacks and a path outside
    the repository are reported; a live path, a glob, a folder, a module.Name and a section that exists are not."""
    doc = tmp_path / "note.md"  # outside tests/: every kind of path is read
    doc.write_text("eagle3/ttt/attention.py eagle3/cost_model.PRESETS eagle3.ttt.attention.TTTCache DESIGN.md "
                   "conf/target/*.toml\n"
                   "eagle3/drafter/attention.py eagle3/replay/cost_model.PRESETS conf/target/*.yaml docs/ "
                   "eagle3.drafter.attention.TTTCache runs/x/train/y.py README.md\n"
                   'docs/design.md "TTT" docs/design.md "No such section" ../shared/NOTES.txt\n')
    found = [b.split(": ", 1)[1] for b in missing_paths([doc])]
    assert found == ["eagle3/ttt/attention.py", "eagle3/cost_model.PRESETS", "conf/target/*.toml",
                     "eagle3.ttt.attention.TTTCache", "DESIGN.md (not in the repository)",
                     "../shared/NOTES.txt (outside the repository)", "docs/design.md has no section 'No such section'"], found

