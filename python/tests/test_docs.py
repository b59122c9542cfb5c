"""No dangling references in README.md and docs/*.md: every relative link
(and its #anchor) resolves, every repository path named in backticks
exists, and every test named exists. A page that moves or a test that is
renamed fails here, not in a reader's hands."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# Pages another change is writing while the README already links them. A
# link to one is accepted only while it is missing; once it exists,
# test_pending_pages_are_still_missing fails until it is taken off here.
PENDING: set[str] = set()


def pages() -> list[pathlib.Path]:
    return [REPO / "README.md", REPO / "python" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.*)$", prose(path.read_text()), re.M)}


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def ignored(path: str) -> bool:
    """Whether git ignores path, as a file or, when it is not there yet
    (a clean clone before `make vllm-venv`), as a directory: a pattern with
    a trailing slash matches only what git can see is a directory."""
    return any(subprocess.run(["git", "check-ignore", "-q", p], cwd=REPO).returncode == 0
               for p in (path, path.rstrip("/") + "/"))


def link_problems(page: pathlib.Path, text: str | None = None) -> list[str]:
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text() if text is None else text)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO):
            bad.append(f"{target}: outside the repository (not in a clone)")
        elif not dest.exists() and str(dest.relative_to(REPO)) not in PENDING:
            bad.append(f"{target}: {dest.relative_to(REPO)} does not exist")
        elif anchor and dest.exists() and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    return bad


def code_spans(text: str) -> list[str]:
    spans = re.findall(r"`([^`\n]+)`", prose(text))
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        spans += block.split()
    return spans


def path_problems(text: str, files: set[str]) -> list[str]:
    """A backticked word (or a word in a code block) that starts with a
    top-level entry of the repository and contains a slash is a path: it
    must exist (in a clean clone: be tracked), or be ignored build output
    (bin/, python/.venv-vllm). `pkg/TestX` and `pkg.TestX` name a test."""
    top = {f.split("/")[0] for f in files}
    dirs = {str(pathlib.PurePosixPath(f).parent) for f in files} | {
        "/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    bad = []
    for span in code_spans(text):
        word = span.strip().rstrip(".,;:)").lstrip("(")
        if "/" not in word or word.split("/")[0] not in top or re.search(r"[<>*{}$\[\]'\"=]", word):
            continue
        if re.search(r"/(Test|Benchmark)\w+$", word):  # rankd/TestName
            continue
        p = word.rstrip("/")
        if p in files or p in dirs or (REPO / p).exists() or ignored(p):
            continue
        bad.append(f"`{span}`: no such path in the repository")
    return bad


def defined_tests() -> dict[str, set[str]]:
    """Every Go test or benchmark and Python test, with the directories
    that define it."""
    out = subprocess.run(["git", "grep", "-E", r"^(func (Test|Benchmark)\w+|def test_\w+)"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    tests: dict[str, set[str]] = {}
    for line in out.splitlines():
        path, _, code = line.partition(":")
        name = re.split(r"[\s(\[]", code.split()[1])[0]
        tests.setdefault(name, set()).add(str(pathlib.PurePosixPath(path).parent))
    return tests


def named_test_problems(text: str, tests: dict[str, set[str]]) -> list[str]:
    """A test named bare must exist somewhere; one named with its package
    (`rankd/TestX`, `transfer.TestX`) must exist in that package."""
    text = prose(text)
    bad = []
    for pkg, name in re.findall(r"\b([a-z][\w/]*)[./]((?:Test|Benchmark)[A-Z]\w*)\b", text):
        dirs = tests.get(name, set())
        if not any(d == pkg or d.endswith("/" + pkg) for d in dirs):
            bad.append(f"{pkg}.{name}: not a test of package {pkg} (defined in {', '.join(sorted(dirs)) or 'none'})")
    named = set(re.findall(r"\b(Test[A-Z]\w*|Benchmark[A-Z]\w*)\b", text))
    named |= {m for m in re.findall(r"`(?:[\w/]+[./])?(test_\w+)`", text) if not m.endswith(".py")}
    named -= {"TestMain"}
    return bad + [f"{t}: no test of that name" for t in sorted(named) if t not in tests]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_dangling_references(page: pathlib.Path) -> None:
    files = tracked() | {str(p.relative_to(REPO)) for p in pages()}
    text = page.read_text()
    bad = link_problems(page, text) + path_problems(text, files) + named_test_problems(text, defined_tests())
    assert not bad, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(bad)


def test_checker_catches_a_bad_link_a_bad_path_and_a_bad_test() -> None:
    page = REPO / "docs" / "probe.md"  # never written: the text is passed in
    text = ("[x](nowhere.md) [y](architecture.md#no-such-heading) [z](../../shared/DESIGN.md) [ok](vllm.md)\n"
            "`deploy/no-such-file.yaml` `TestNoSuchTestAnywhere` `transfer/` `python/.venv-vllm`\n"
            "`cluster.TestLeaveAnnouncementLost` `index.TestLeaveAnnouncementLost`\n")
    bad = link_problems(page, text) + path_problems(text, tracked()) + named_test_problems(text, defined_tests())
    assert len(bad) == 6, bad


def connector_keys() -> set[str]:
    src = (REPO / "python" / "src" / "kvtier" / "vllm" / "connector.py").read_text()
    body = src[src.index("def of(cls"):]
    body = body[:body.index("\n    def ", 1)]
    return set(re.findall(r"""extra\.get\(\s*["'](kvtier_\w+)["']""", body))


def test_every_connector_key_is_documented() -> None:
    """docs/vllm.md's key table lists exactly the keys Config.of reads."""
    text = (REPO / "docs" / "vllm.md").read_text()
    m = re.search(r"<!-- connector-keys.*?-->(.*?)<!-- /connector-keys -->", text, re.S)
    assert m, "docs/vllm.md: no <!-- connector-keys --> table"
    rows = set(re.findall(r"^\| `(kvtier_\w+)` \|", m.group(1), re.M))
    keys = connector_keys()
    assert keys, "no kv_connector_extra_config keys found in Config.of"
    assert rows == keys, f"undocumented: {sorted(keys - rows)}; documented but not read: {sorted(rows - keys)}"


def test_pending_pages_are_still_missing() -> None:
    landed = sorted(p for p in PENDING if (REPO / p).exists())
    assert not landed, f"{landed} exist now: take them off PENDING in python/tests/test_docs.py"
