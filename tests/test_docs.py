"""The documentation: the README stays a front door, its reading-order table matches the files,
its test command is the one CI runs, and every relative link in the Markdown resolves to a
file (and, with an anchor, to a heading of that file)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "benchmarks" / "results" / "notebook.md"]


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped (letters, digits,
    spaces, hyphens and underscores kept), spaces turned into hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = github_anchor(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


def test_github_anchor_follows_githubs_rule():
    assert github_anchor(" Planning a run at scale: `mpidl.plan`") == "planning-a-run-at-scale-mpidlplan"
    assert github_anchor(" Node-based communication (K')") == "node-based-communication-k"
    assert github_anchor(" Data: the NaN scan and `--cache`") == "data-the-nan-scan-and---cache"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.exists() and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_is_a_front_door():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_readme_reading_order_counts_match_the_files():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "reading_order.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = README.read_text(encoding="utf-8")
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.S))
    assert re.search(r"^bash tests/run_all\.sh(\s|$)", blocks, flags=re.M)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"&& bash tests/run_all\.sh\)$", ci, flags=re.M)


def test_readme_install_and_run_command():
    readme = README.read_text(encoding="utf-8")
    assert "pip install -e '.[test,mpich]' && mpiexec -n 4 python -m mpidl.train" in readme
