"""House rules, as a reviewer checks them: `ruff check` clean under pyproject.toml's settings (line length 120,
pycodestyle, pyflakes, blind excepts); the README within its 150 lines, opening with the two commands; and the
modules' imports (every import statement, lazy ones included) form no cycle, point down docs/architecture.md's
layers only (LAYERS: the core never imports eval), and nothing imports the command line (lynx_hf.cli only registers
the commands); the entry points users type still start (`python -m lynx_hf.vllm.proxy`, its old name)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (  # docs/architecture.md's layers, lowest first: a module imports its own layer's and lower ones' only
    ("settings, shapes, errors", ("lynx_hf", "lynx_hf.config", "lynx_hf.arch", "lynx_hf.errors", "lynx_hf.trace",
                                  "lynx_hf.floors")),
    ("codec", ("lynx_hf.kernels", "lynx_hf.quant")),
    ("decode-side KV", ("lynx_hf.loader", "lynx_hf.cache")),
    ("acceptance math", ("lynx_hf.spec", "lynx_hf.tree")),
    ("engine", ("lynx_hf.engine", "lynx_hf.streamer")),
    ("nodes", ("lynx_hf.model", "lynx_hf.width", "lynx_hf.local", "lynx_hf.link", "lynx_hf.flags", "lynx_hf.transfer",
               "lynx_hf.session")),
    ("vLLM plugins", ("lynx_hf.vllm",)),
    ("beside vLLM", ("lynx_hf.vllm.serve", "lynx_hf.vllm.proxy")),
    ("front ends", ("lynx_hf.hub", "lynx_hf.hub_folder", "lynx_hf.eval", "lynx_hf.cli")),
)


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
    assert not [f"{m} -> {w}" for m, e in edges.items() for w in e if _layer(w) > _layer(m)]
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


def _layer(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module`'s layer."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    assert found, f"{module}: in no layer of LAYERS (docs/architecture.md)"
    return max(found)[1]


def test_every_module_has_a_layer_and_a_probe_upwards_is_caught():
    edges = _imports()
    assert all(_layer(m) >= 0 for m in edges)
    assert _layer("lynx_hf.cache.store") < _layer("lynx_hf.local") < _layer("lynx_hf.vllm.scheduler") \
        < _layer("lynx_hf.vllm.serve.proxy") < _layer("lynx_hf.eval.lib.data")


def test_the_proxy_still_starts_under_its_old_name():
    for name in ("lynx_hf.vllm.proxy", "lynx_hf.vllm.serve.proxy"):
        r = subprocess.run([sys.executable, "-m", name, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "usage: lynx-hf vllm-proxy" in r.stdout, r.stdout + r.stderr
