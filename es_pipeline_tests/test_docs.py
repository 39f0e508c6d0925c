"""The docs name only paths that exist, and docs/architecture.md's "Layout" names every package.

Pure: it reads files, imports nothing of es_pipeline, needs no database and no Spark.

What counts as a path, in README.md, docs/**/*.md, bench/README.md and bench/results/*.md (fenced code blocks
left out: they hold commands and trees, often of a user's project):
- a link's target, unless it is a URL; an anchor (`#layout`) must be a heading of the file it points to;
- a word in backticks, or a word of a command in backticks, that ends in a file extension this repository uses
  (`.py`, `.md`, `.toml`, `.yaml`, `.yml`, `.json`, `.sh`) or starts with one of its folders and a `/`
  (`lake/`, `docs/`, `.ci/`, …);
- a word in the prose that contains a `/` and ends in such an extension (lake/typed/shapes.py);
- a dotted module: `es_pipeline.lake.state.fold`, or relative to es_pipeline/ (`lake.kernel.turn.Turn`).

A path is found when it exists under the repository's root, es_pipeline/, es_pipeline_tests/ or the
markdown file's own folder; a bare file name (`fold.py`) when a file of that name exists in the repository;
a module's path and a name in it (`store/conninfo.resolved`) when the module defines the name. A dotted
module is found when its longest prefix that is a module or package exists and the module defines what
follows (`Domain` in `es_pipeline.domain.Domain`). Words with placeholders (`<name>`, `*`, `NNNN`, `…`, `=`)
and absolute paths are not this repository's and are skipped. What is left and is still not a path of this
repository is in `ALLOWED`, with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "es_pipeline"
TESTS = ROOT / "es_pipeline_tests"

EXTENSIONS = (".py", ".md", ".toml", ".yaml", ".yml", ".json", ".sh")
TOP_FOLDERS = ("es_pipeline", "es_pipeline_tests", "docs", "bench", "examples", "scripts", ".ci")
# Folders of a working copy that hold no file the docs may name (and hidden ones, but for .ci).
_SKIP_DIRS = {"__pycache__", "node_modules", "target", "spark-warehouse", "metastore_db", "bench/work"}

# Names in the docs that look like this repository's paths and are not, each with why.
ALLOWED: dict[str, str] = {
    "es_pipeline/slice_range": "a Dagster run tag (dagster.yaml), not a folder",
    "bench/work/": "the benchmarks' working folder, git-ignored, made by a run and removed after it",
    "path/to/mapping.toml": "docs/sources.md: where a team's own mapping file goes",
    "es_pipeline_rules.yml": "docs/operations.md: the operator's file, written by the command beside it",
    "dg.toml": "dg's own project file (docs/decisions/0044): a dg project may have it instead of pyproject.toml",
    "lake/delta/feed.py": "decision 0037's layout, as it was: split by decision 0049 (lake/kernel/, lake/delta/current.py)",
    "lake/delta/serial.py": "decision 0037's layout, as it was: moved by decision 0049 to lake/kernel/turn.py",
}

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"`([^`]+)`")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_PROSE_PATH = re.compile(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)+)")
_MODULE = re.compile(r"^es_pipeline(?:\.\w+)+(?::\w+)?$")
_RELATIVE_MODULE = re.compile(r"^([a-z_]+)(?:\.\w+)+$")  # `lake.kernel.turn.Turn`, relative to es_pipeline
_PLACEHOLDER = re.compile(r"[<>*?{}$|=…\[\]]|NNNN|\.\.\.")


def doc_files() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    docs += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "bench" / "results").glob("*.md"))
    return [d for d in docs if d.is_file()]


def _prefixes() -> set[str]:
    """The folders a repository path may start with: the top level's, and es_pipeline's and its tests' own."""
    found = set(TOP_FOLDERS)
    for base in (PACKAGE, TESTS):
        found |= {d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))}
    return found


def _file_names() -> set[str]:
    names: set[str] = set()
    for path in _walk(ROOT):
        names.add(path.name)
    return names


def _walk(folder: Path) -> Iterator[Path]:
    try:
        entries = list(folder.iterdir())
    except OSError:  # removed meanwhile by a test tier beside this one (docs/decisions/0036-test-tiers.md)
        return
    for path in entries:
        rel = path.relative_to(ROOT).as_posix()
        if path.is_dir():
            hidden = path.name.startswith(".") and path.name != ".ci"
            skipped = path.name in _SKIP_DIRS or rel in _SKIP_DIRS or path.name.startswith("warehouse")
            if not hidden and not skipped:
                yield from _walk(path)
        else:
            yield path


def _top_modules() -> set[str]:
    """es_pipeline's packages and modules, which a dotted name relative to es_pipeline starts with."""
    return {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("_")}


PREFIXES = _prefixes()
TOP_MODULES = _top_modules()
FILE_NAMES = _file_names()


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _clean(word: str) -> str:
    word = word.strip().strip("\"'(),;")
    word = word.split("::", 1)[0]  # a pytest node id: its file
    word = word.split("#", 1)[0]  # a link's anchor
    word = re.sub(r":\d+$", "", word)  # a line number
    return word.rstrip(".:,;")


def _looks_like_repo_path(word: str) -> bool:
    if not word or word.startswith(("/", "~", "-")) or _PLACEHOLDER.search(word):
        return False
    if word.endswith(EXTENSIONS):
        return True
    first = word.removeprefix("./").split("/", 1)[0]
    return "/" in word and first in PREFIXES


def candidates(text: str) -> Iterator[tuple[int, str]]:
    """(line, word) for every word of `text` that names a path or module of this repository."""
    for number, line in _prose_lines(text):
        for target in _LINK.findall(line):
            if not _URL.match(target) and not target.startswith("mailto:"):
                word = target if "#" in target else _clean(target)
                if word and not _PLACEHOLDER.search(word):
                    yield number, word
        for code in _CODE.findall(line):
            for word in (_clean(w) for w in re.split(r"[\s(),]+", _URL.sub(" ", code))):
                if _MODULE.match(word) or _looks_like_repo_path(word) or _relative_module(word):
                    yield number, word
        prose = _URL.sub(" ", _CODE.sub(" ", _LINK.sub("] ", line)))
        for word in (_clean(w) for w in _PROSE_PATH.findall(prose)):
            if word.endswith(EXTENSIONS) and _looks_like_repo_path(word):
                yield number, word


def _defines(source: Path, name: str) -> bool:
    """Whether the module `source` defines or imports `name` (read, not imported)."""
    n = re.escape(name)
    pattern = rf"^\s*(?:async\s+def|def|class)\s+{n}\b|^\s*{n}\s*[:=]|^\s*(?:from\s+\S+\s+)?import\b.*\b{n}\b"
    return re.search(pattern, source.read_text(), re.MULTILINE) is not None


def _relative_module(word: str) -> bool:
    match = _RELATIVE_MODULE.match(word)
    return match is not None and match.group(1) in TOP_MODULES and not word.endswith(EXTENSIONS)


def _module_exists(parts: list[str], base: Path) -> bool:
    """Whether `parts` is a module or package under `base`, then names defined in it (`domain`, `Domain`)."""
    for end in range(len(parts), 0, -1):
        path = base.joinpath(*parts[:end])
        source = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if source.is_file():
            return end == len(parts) or _defines(source, parts[end])
    return False


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchor_exists(word: str, doc: Path) -> bool:
    target, _, anchor = word.partition("#")
    path = (doc.parent / target) if target else doc
    if not path.is_file():
        return False
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", path.read_text(), re.MULTILINE)
    return anchor in {slug(h) for h in headings}


def exists(word: str, doc: Path) -> bool:
    if word in ALLOWED:
        return True
    if "#" in word:
        return _anchor_exists(word, doc)
    if _MODULE.match(word):
        # es_pipeline.<name> is also a PostgreSQL schema, and a prefix of Delta app ids and table properties:
        # only a name under a module or package of es_pipeline is taken for a module.
        top = word.split(".")[1].split(":")[0]
        if not ((PACKAGE / top).is_dir() or (PACKAGE / f"{top}.py").is_file()):
            return True
        return _module_exists(word.replace(":", ".").split("."), ROOT)
    if _relative_module(word):
        return _module_exists(word.split("."), PACKAGE)
    path = word.removeprefix("./").rstrip("/")
    if "/" not in path and path in FILE_NAMES:
        return True
    bases = (ROOT, PACKAGE, TESTS, doc.parent)
    if any((base / path).exists() for base in bases):
        return True
    # `store/conninfo.resolved`: a module's path, then a name in it
    folder, _, last = path.rpartition("/")
    module, _, name = last.partition(".")
    return bool(name) and not path.endswith(EXTENSIONS) and any(
        _module_exists([*folder.split("/"), module, name], base) for base in bases)


def test_the_docs_name_only_paths_that_exist() -> None:
    missing = [f"{doc.relative_to(ROOT)}:{line}: {word}"
               for doc in doc_files() for line, word in candidates(doc.read_text()) if not exists(word, doc)]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def layout_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_layout_names_every_package() -> None:
    section = layout_section()
    packages = sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")
                      if "__pycache__" not in p.parts and p.parent != PACKAGE)
    missing = [p for p in packages if f"`{p}/`" not in section and f"`es_pipeline/{p}/`" not in section]
    assert not missing, f'docs/architecture.md, "## Layout", names no line for the packages {missing}'


@pytest.mark.parametrize(("text", "words"), [
    ("see `lake/state/fold.py` and [ops](operations.md#health)",
     ["lake/state/fold.py", "operations.md#health"]),
    ("the rule of lake/typed/shapes.py, widened", ["lake/typed/shapes.py"]),
    ("`es-pipeline sql \"SELECT 1\"` on `events_<type>` under `warehouse/events`", []),
    ("`e2e/test_end_to_end.py::test_killed`, http://127.0.0.1:3000/x.json, `docs/decisions/NNNN-title.md`",
     ["e2e/test_end_to_end.py"]),
    ("`python -c \"import es_pipeline.definitions\"`, `es_pipeline.offsets`", ["es_pipeline.definitions",
                                                                               "es_pipeline.offsets"]),
    ("```\nlake/nothing.py\n```\n`*.md`, `.ci/run`", [".ci/run"]),
])
def test_what_counts_as_a_path(text: str, words: list[str]) -> None:
    assert sorted(w for _, w in candidates(text)) == sorted(words)


@pytest.mark.parametrize(("word", "found"), [
    ("lake/state/fold.py", True), ("es_pipeline/lake/state/fold.py", True), ("docs/operations.md", True),
    ("lake/small_increments.py", False), ("fold.py", True), ("small_snapshots.py", False), (".ci/run", True),
    ("es_pipeline.lake.state.fold", True), ("es_pipeline.lake.projection", False),
    ("es_pipeline.domain.Domain", True), ("es_pipeline.domain.NoSuchName", False),
    ("es_pipeline.sinks", True),
    ("extraction/test_tail.py", True), ("store/conninfo.resolved", True), ("store/conninfo.nothing", False),
    ("#layout", True), ("#no-such-heading", False),
    ("decisions.md#tailing-runs-es_pipeline_tail_seconds-300-by-default", True),
])
def test_what_exists(word: str, found: bool) -> None:
    assert exists(word, ROOT / "docs" / "architecture.md") is found
