"""House rules, as a reviewer checks them: `ruff check` clean under pyproject.toml's settings (line length 120,
pycodestyle, pyflakes, blind excepts); the README within its 150 lines, opening with the two commands; and the
modules' imports (every import statement, lazy ones included) form no cycle, the core (lynx_hf outside eval) never
imports eval, and nothing imports the command line (lynx_hf.cli only registers the commands)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-1000:]) or "ruff missing: pip install -e '.[test]'"


def test_the_readme_fits_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    assert [line.split()[:2] for line in lines[2:5] if line.startswith("bash")] == [["bash", "bootstrap.sh"]] * 2


def _imports() -> dict[str, set[str]]:
    """{module: the project modules its import statements name} over lynx_hf/ and eval/ (eval is lynx_hf.eval)."""
    files = {}
    for base in ("lynx_hf", "eval"):
        for f in (ROOT / base).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join((["lynx_hf"] if base == "eval" else []) + parts)] = f
    out = {}
    for mod, f in files.items():
        pkg = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        names = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                names |= {base} | {f"{base}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        out[mod] = {n for n in names if n in files and n != mod}
    return out


def test_no_import_cycle_and_no_import_upwards():
    edges = _imports()
    packages = {m for m in edges if any(o.startswith(m + ".") for o in edges)}  # (a package face re-exports)
    assert not [f"{m} -> cli" for m, e in edges.items() if "lynx_hf.cli" in e]
    assert not [f"{m} -> {w}" for m, e in edges.items() if not m.startswith(("lynx_hf.eval", "lynx_hf.cli"))
                for w in e if w.startswith("lynx_hf.eval")]
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for w in sorted(edges[m] - packages):
            assert state.get(w) != 1, " -> ".join(path + [w])
            if w not in state:
                visit(w, path + [w])
        state[m] = 2

    for m in sorted(set(edges) - packages):
        if m not in state:
            visit(m, [m])
