"""The Hub repository's `custom_generate/` folder, self-contained: `generate.py` (a shim with the repo's codec
settings inlined), a flat copy of the Lynx runtime it runs, and `requirements.txt` listing only what the package index
has (torch, transformers).

Transformers loads `custom_generate/generate.py` as a module and copies along the sibling files it imports with
`from .name import ...` (flat: no sub-packages), so `write_custom_generate` copies the import closure of
`lynx_hf.hub` into `lynx_<path>.py` files and rewrites every import of the package into that form. Modules that
need more than torch, transformers and the standard library (the C and Triton kernels) stay behind: their imports
become `raise ImportError(...)`, which the codec's dispatch answers with its pure-torch twin (bit-identical codes).
Generated from the installed package at card time, so the folder never drifts from it."""
from __future__ import annotations

import ast
import importlib.util
import os
import sys

ROOT = "lynx_hf.hub"  # what generate.py calls
ALLOWED = {"torch", "transformers", "numpy", "huggingface_hub", "safetensors", "__future__"}  # torch/transformers deps
LEFT_OUT = {"lynx_hf.kernels.cpu"}  # builds kernels/codec_cpu.c, a file Transformers would not copy

SHIM = ('''"""Lynx: progressive speculative KV quantization, as a Transformers custom_generate '''
        '''(written by `lynx-hf card`).

    model.generate(input_ids, custom_generate=THIS_REPO, trust_remote_code=True, max_new_tokens=64)

decodes exactly as plain `generate` on the Lynx full tier: drafts on the 4-bit anchor of the prompt's KV while the
residual is pending (here: after {residual_after} draft steps, a local stand-in for the transfer), then verifies.
Pass cache=LynxCache(...) to decode a KV transferred from a prefill node instead. The lynx_*.py files beside this
one are the Lynx runtime (lynx-hf {version}), copied flat: nothing else to install."""
from .lynx_hub import hub_generate

LYNX_CONFIG = {config}
RESIDUAL_AFTER_STEPS = {residual_after}


def generate(model, *args, **kwargs):
    kwargs.setdefault("residual_after_steps", RESIDUAL_AFTER_STEPS)
    return hub_generate(model, LYNX_CONFIG, *args, **kwargs)
''')


def _source(module: str) -> tuple[str, bool] | None:
    """(file, is_package) of a module of this package, found without importing it (its parent package is)."""
    spec = importlib.util.find_spec(module.rsplit(".", 1)[0])
    for d in (spec.submodule_search_locations or []) if spec else []:
        name = module.rsplit(".", 1)[-1]
        if os.path.isfile(os.path.join(d, name, "__init__.py")):
            return os.path.join(d, name, "__init__.py"), True
        if os.path.isfile(os.path.join(d, name + ".py")):
            return os.path.join(d, name + ".py"), False
    return None


def flat_name(module: str) -> str:
    """lynx_hf.quant.lynx → lynx_quant_lynx; lynx_hf.hub → lynx_hub; the package itself → lynx_package (its
    version only: the runtime imports nothing else from it)."""
    return "lynx_package" if module == "lynx_hf" else "lynx_" + module.split(".", 1)[1].replace(".", "_")


def _target(node: ast.ImportFrom, package: str) -> str | None:
    if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module


def _imports(tree: ast.AST, package: str):
    """(node, target module, [(name, asname)]) for every import of this package in `tree`."""
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            t = _target(n, package)
            if t and (t == "lynx_hf" or t.startswith("lynx_hf.")):
                yield n, t, [(a.name, a.asname) for a in n.names]
        elif isinstance(n, ast.Import) and any(a.name.split(".")[0] == "lynx_hf" for a in n.names):
            raise ValueError(f"`import {n.names[0].name}` in the runtime: write `from ... import ...`")


def _third_party(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
            out.add(n.module.split(".")[0])
    return {m for m in out if m != "lynx_hf" and m not in sys.stdlib_module_names}


def runtime_modules() -> dict[str, tuple[str, bool]]:
    """The import closure of ROOT inside the package: module → (file, is_package). A module importing anything
    beyond ALLOWED is left out (with whatever only it imports)."""
    found, todo = {}, [ROOT]
    while todo:
        m = todo.pop()
        if m in found or m in LEFT_OUT:
            continue
        if m == "lynx_hf":
            found[m] = (None, True)  # written as lynx_package.py: __version__ only
            continue
        src = _source(m)
        if src is None:
            continue  # a name imported from a module, not a module
        tree = ast.parse(open(src[0], encoding="utf-8").read())
        if _third_party(tree) - ALLOWED:
            continue
        found[m] = src
        package = m if src[1] else m.rsplit(".", 1)[0]
        for _, t, names in _imports(tree, package):
            todo.append(t)
            todo.extend(f"{t}.{name}" for name, _ in names)
    return found


def _rewrite(node: ast.ImportFrom, target: str, names, modules) -> list[str]:
    """The flat statements that replace one import of the package."""
    if target not in modules:
        return [f"raise ImportError({f'{target} is not part of the Hub folder (compiled kernels stay behind)'!r})"]
    lines, plain = [], []
    for name, asname in names:
        sub = f"{target}.{name}"
        if sub in modules:  # a module object: load its file (the first line is what Transformers follows), bind it
            lines += [f"from .{flat_name(sub)} import __name__ as _{flat_name(sub)}",
                      f"from . import {flat_name(sub)} as {asname or name}"]
        else:
            plain.append(f"{name} as {asname}" if asname else name)
    if plain:
        lines.insert(0, f"from .{flat_name(target)} import {', '.join(plain)}")
    return lines


def flatten(module: str, modules: dict) -> str:
    """One runtime module's source with every import of the package in flat form (indentation kept)."""
    path, is_pkg = modules[module]
    text = open(path, encoding="utf-8").read()
    package = module if is_pkg else module.rsplit(".", 1)[0]
    lines = text.splitlines(keepends=True)
    edits = sorted(((n.lineno, n.end_lineno, n.col_offset, _rewrite(n, t, names, modules))
                    for n, t, names in _imports(ast.parse(text), package)), reverse=True)
    for first, last, col, new in edits:
        pad = " " * col
        lines[first - 1:last] = [pad + s + "\n" for s in new]
    return "".join(lines)


def requirements() -> list[str]:
    """torch and transformers as this package requires them (its installed metadata), else as installed here."""
    from importlib import metadata

    try:
        reqs = [r.split(";")[0].strip() for r in metadata.requires("lynx-hf") or []]
    except metadata.PackageNotFoundError:
        reqs = []
    out = [r for r in reqs if r.split("<")[0].split(">")[0].split("=")[0].strip() in ("torch", "transformers")]
    if len(out) == 2:
        return out
    import torch
    import transformers

    return [f"torch>={torch.__version__.split('+')[0]}", f"transformers>={transformers.__version__}"]


def write_custom_generate(folder, lynx_config, residual_after_steps: int = 8) -> list[str]:
    """Write `custom_generate/` into a repo folder: generate.py, the flat runtime, requirements.txt. Returns the
    file names written."""
    from . import __version__

    d = os.path.join(folder, "custom_generate")
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):  # a runtime from an earlier card must not linger
        if f.startswith("lynx_") and f.endswith(".py"):
            os.remove(os.path.join(d, f))
    modules = runtime_modules()
    written = ["generate.py", "requirements.txt"]
    for m in sorted(modules):
        with open(os.path.join(d, flat_name(m) + ".py"), "w", encoding="utf-8") as f:
            f.write(f'"""lynx-hf\'s version, for the runtime beside this file."""\n__version__ = {__version__!r}\n'
                    if m == "lynx_hf" else flatten(m, modules))
        written.append(flat_name(m) + ".py")
    with open(os.path.join(d, "generate.py"), "w", encoding="utf-8") as f:
        f.write(SHIM.format(config=repr(lynx_config.to_dict()), residual_after=int(residual_after_steps),
                            version=__version__))
    with open(os.path.join(d, "requirements.txt"), "w") as f:
        f.write("".join(r + "\n" for r in requirements()))
    return written
