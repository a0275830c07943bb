"""The module layout of ARCHITECTURE.md, checked on the source: every import statement of every
project module (ast, including imports inside functions), resolved to the project's own modules.

  * a stage folder (data/, train/, eval/, export/) imports no module of another stage folder, nor of
    pipeline/: shared code lives in eagle3/;
  * pipeline/ (the demo, the study, the learning A/B) is the one folder that imports several stage
    folders, directly (their run functions); nothing but pipeline/, tests/ and benchmarks/ imports it;
  * stage and pipeline modules import nothing by name at run time (importlib.import_module / __import__):
    only eagle3 resolves modules by name (the schema lookup), so the ast walk sees every dependency;
  * eagle3/ imports no stage folder, nor pipeline/, tests/ or benchmarks/;
  * no import cycle among the project's modules;
  * tests take shared helpers from tests/fixtures/, never from another test module or a conftest;
  * eagle3's schemas and pure modules import without torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from eagle3 import REPO_ROOT

STAGE_FOLDERS = ("data", "train", "eval", "export")
PIPELINE = "pipeline"  # the one folder that runs several stages
PROJECT_FOLDERS = ("eagle3",) + STAGE_FOLDERS + (PIPELINE, "benchmarks", "tests")
# eagle3 modules that import without torch today (light tools and the GPU image read them); the
# schemas (every eagle3/config/schema/*.py) are added below.
TORCH_FREE = ("eagle3", "eagle3.engines.aux_layers", "eagle3.config.choices", "eagle3.config.conf", "eagle3.replay.cost_model",
              "eagle3.cpu_threads", "eagle3.drafter.drafter_keys", "eagle3.errors", "eagle3.hooks", "eagle3.formats.manifest",
              "eagle3.engines.serve_launch", "eagle3.replay", "eagle3.real_loop", "eagle3.target_model.images", "eagle3.media_tokens",
              "eagle3.fingerprints", "eagle3.stage_dir", "eagle3.config.resolve", "eagle3.engines.serve_costs",
              "eagle3.config.watermarks", "eagle3.formats.spool")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every Python module in the project folders."""
    return {module_name(p): p for folder in PROJECT_FOLDERS for p in sorted((REPO_ROOT / folder).rglob("*.py"))
            if "__pycache__" not in p.parts}


def _resolve(name: str, importer: str) -> str | None:
    """The project module an imported dotted name loads (its longest project prefix), or None for
    an outside package. Under tests/, a bare name may be a module next to the importer or in a folder
    above it (pytest puts test folders on sys.path: `from hooked_stage import ...`)."""
    mods = project_modules()
    bases = [""]
    if importer.startswith("tests."):
        pkg = importer.split(".")[:-1]
        bases += [".".join(pkg[:i]) + "." for i in range(len(pkg), 0, -1)]
    for base in bases:
        parts = (base + name).split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
    return None


@lru_cache(maxsize=None)
def imports_of(module: str) -> tuple[tuple[str, int], ...]:
    """(project module, line) for every import statement in `module`'s source, at any depth."""
    path = project_modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from P import n`: the submodule P.n when there is one, else P itself
            names = [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}", module) == f"{base}.{a.name}" else base
                     for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, module)
            if target is not None and target != module:
                out.append((target, node.lineno))
    return tuple(dict.fromkeys(out))


def folder(module: str) -> str:
    return module.split(".")[0]


def test_every_project_module_parses():
    """The walk below reads every module; one that does not parse would hide its imports."""
    mods = project_modules()
    assert {"pipeline.demo", "export.stage", "eval.stage", "train.stage", "data.capture", "tests.test_layout"} <= set(mods)
    for module in mods:
        imports_of(module)


def stage_crossings() -> list[str]:
    return [f"{module} imports {target} (line {line})"
            for module in project_modules() if folder(module) in STAGE_FOLDERS
            for target, line in imports_of(module)
            if folder(target) in STAGE_FOLDERS + (PIPELINE,) and folder(target) != folder(module)]


def test_no_stage_folder_imports_another():
    bad = stage_crossings()
    assert not bad, "a stage folder imports another stage's module or pipeline/ (move shared code to eagle3/, " \
                    "or run the stages from pipeline/):\n" + "\n".join(bad)


def test_only_pipeline_tests_and_benchmarks_import_pipeline():
    bad = [f"{module} imports {target} (line {line})" for module in project_modules()
           if folder(module) not in (PIPELINE, "tests", "benchmarks")
           for target, line in imports_of(module) if folder(target) == PIPELINE]
    assert not bad, "pipeline/ runs the stages; nothing below it may import it:\n" + "\n".join(bad)


def test_pipeline_imports_the_stages_it_runs_directly():
    """The orchestrators reach every stage folder through plain imports (no registry by name)."""
    reached = {folder(t) for m in project_modules() if folder(m) == PIPELINE for t, _ in imports_of(m)}
    assert set(STAGE_FOLDERS) <= reached, sorted(set(STAGE_FOLDERS) - reached)


def test_the_walk_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """A lazy import (inside a function) of another stage's module is found, with its line."""
    fake = tmp_path / "eval" / "lazy.py"
    fake.parent.mkdir()
    fake.write_text("import json\n\n\ndef f():\n    from train.stage import run_train\n    return run_train\n")
    monkeypatch.setitem(project_modules(), "eval.lazy", fake)
    try:
        assert "eval.lazy imports train.stage (line 5)" in stage_crossings()
    finally:
        imports_of.cache_clear()


def test_stage_modules_import_nothing_by_name_at_run_time():
    bad = []
    for module, path in project_modules().items():
        if folder(module) not in STAGE_FOLDERS + (PIPELINE,):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called in ("import_module", "__import__"):
                    bad.append(f"{module} line {node.lineno}: {called}(...)")
    assert not bad, "stage and pipeline modules import what they use by name, not at run time:\n" + "\n".join(bad)


def test_core_package_imports_no_stage_tests_or_benchmarks():
    bad = [f"{module} imports {target} (line {line})" for module in project_modules() if folder(module) == "eagle3"
           for target, line in imports_of(module) if folder(target) != "eagle3"]
    assert not bad, "eagle3/ must import only eagle3 (and outside packages):\n" + "\n".join(bad)


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in imports_of(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(project_modules())))
    try:
        for v in project_modules():
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    """The walk is not vacuous: a planted two-module loop is reported."""
    real = imports_of

    def planted(module):
        extra = (("eagle3.errors", 1),) if module == "eagle3.config.choices" else ()
        extra += (("eagle3.config.choices", 1),) if module == "eagle3.errors" else ()
        return real(module) + extra

    monkeypatch.setattr(sys.modules[__name__], "imports_of", planted)
    assert ["eagle3.config.choices", "eagle3.errors"] in import_cycles()


def test_tests_take_helpers_from_fixtures_not_from_test_modules():
    bad = [f"{module} imports {target} (line {line})" for module in project_modules() if folder(module) == "tests"
           for target, line in imports_of(module)
           if target.rpartition(".")[2].startswith("test_") or target.rpartition(".")[2] == "conftest"]
    assert not bad, "shared test helpers belong in tests/fixtures/ (fixtures imported from there):\n" + "\n".join(bad)


def test_schemas_and_pure_core_modules_import_without_torch():
    schemas = sorted(m for m in project_modules() if m.startswith("eagle3.config.schema."))
    code = ("import importlib, sys\n"
            "sys.modules['torch'] = None  # any import of torch fails\n"
            f"for m in {list(TORCH_FREE) + schemas!r}: importlib.import_module(m)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr.strip().splitlines()[-1]


def test_architecture_names_every_module():
    """ARCHITECTURE.md maps every module: each is named there by its file name (schemas by schema/<stage>.py)."""
    text = (REPO_ROOT / "ARCHITECTURE.md").read_text()
    unnamed = [str(p.relative_to(REPO_ROOT)) for m, p in project_modules().items()
               if folder(m) in ("eagle3", PIPELINE) + STAGE_FOLDERS and p.name != "__init__.py"
               and p.name not in text and not m.startswith("eagle3.config.schema.")]
    assert not unnamed, "add a line for each to ARCHITECTURE.md:\n" + "\n".join(unnamed)


# Inside eagle3/, pairs that once ran back up (issue 42): the drafter owns the caches its step attends
# through, so it never reaches for the training numerics; the export spec lives in export/, so the file
# formats never reach for the drafter.
NEVER_IMPORTS = (("eagle3.drafter", "eagle3.ttt"), ("eagle3.formats", "eagle3.drafter"))


def core_back_arrows(pairs=NEVER_IMPORTS) -> list[str]:
    return [f"{module} imports {target} (line {line})" for low, high in pairs
            for module in project_modules() if module == low or module.startswith(low + ".")
            for target, line in imports_of(module) if target == high or target.startswith(high + ".")]


def test_no_back_arrow_between_core_subpackages():
    bad = core_back_arrows()
    assert not bad, "an eagle3 subpackage imports one that stands above it:\n" + "\n".join(bad)


def test_the_back_arrow_check_sees_a_real_import():
    """Not vacuous: the walk does find the arrows that run the other way (the unrolls use the drafter)."""
    assert any("eagle3.ttt." in line for line in core_back_arrows((("eagle3.ttt", "eagle3.drafter"),)))
