"""`lynx-hf bench startup`: how fast the command and the default model start, each in a fresh process.

    help_s        `lynx-hf --help` (median of 5; imports no torch)
    import_s      `import torch, transformers, lynx_hf` in that process (paid by any torch program)
    load_cold_s   then load_default_model() with an empty conversion cache (the GGUF file is converted and cached)
    load_warm_s   load_default_model() again (the cached safetensors; median of 3)
Prints the numbers and a final JSON line. Targets (issue 20): help under 1 s, a warm load under 3 s."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from lynx_hf.eval.lib.harness import final_line, printer

LOAD = ("import time; t0 = time.perf_counter(); import torch, transformers, lynx_hf; t = time.perf_counter(); "
        "lynx_hf.load_default_model(); print(time.perf_counter() - t, t - t0)")


def _wall(cmd: list[str], env=None) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    return time.perf_counter() - t


def _load_s(env) -> tuple[float, float]:
    """(load seconds, import seconds) in a fresh process."""
    p = subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True, text=True, env=env, timeout=600)
    load, imports = map(float, p.stdout.strip().splitlines()[-1].split())
    return load, imports


def run(as_json: bool = False) -> dict:
    say = printer(as_json)
    exe = shutil.which("lynx-hf")
    cmd = [exe, "--help"] if exe else [sys.executable, "-m", "lynx_hf.cli", "--help"]
    _wall(cmd)  # warm the file cache
    help_s = statistics.median(_wall(cmd) for _ in range(5))
    say(f"{' '.join(os.path.basename(c) for c in cmd)}: {help_s:.3f} s")
    cache = tempfile.mkdtemp(prefix="lynx-bench-cache-")
    try:
        env = dict(os.environ, LYNX_CACHE=cache)
        cold, _ = _load_s(env)
        say(f"load_default_model(), conversion cache empty: {cold:.2f} s")
        runs = [_load_s(env) for _ in range(3)]
        warm, imports = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        say(f"load_default_model(), cached: {warm:.2f} s (after {imports:.2f} s of importing torch and transformers)")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    res = {"help_s": help_s, "import_s": imports, "load_cold_s": cold, "load_warm_s": warm,
           "help_under_1s": help_s < 1.0, "load_warm_under_3s": warm < 3.0}
    return final_line(res)


def register(bench) -> None:
    """`lynx-hf bench startup` (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts)
    from lynx_hf.flags import JSON_HELP, subcommand

    p = subcommand(bench, "startup", "`lynx-hf --help` and the default model's load, each in a fresh process")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(a.json)
