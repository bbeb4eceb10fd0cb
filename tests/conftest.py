import os
from pathlib import Path

# The fast tier runs on pytest-xdist's workers (pyproject.toml: `-n auto --dist loadfile`): each worker gets its share
# of the cores for its thread pools, set before torch starts them (two workers of two threads each on two cores ran
# the fast tier in 3:10, one thread each in 2:06). `bash bootstrap.sh test` runs both tiers in one process (`-n 0`).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _workers))

# Triton kernels run on CPU tensors through the interpreter here; this must be set before triton is imported.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # noqa: BLE001 — a broken CUDA probe means no CUDA  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"  # small public-data slices: tests read nothing outside the clone
REAL_MODEL = {"model_and_tok", "shakespeare_ids", "eval_prompts"}  # fixtures that load the 135M default model


def pytest_collection_modifyitems(config, items):
    """Tiers: a test on the real default model is `slow` (as are subprocess CLI runs and spawned processes, marked
    where they stand). `pytest` runs the fast tier (scripted engine, pure math, tiny random models);
    `bash bootstrap.sh test` (CI) runs both."""
    for item in items:
        if REAL_MODEL & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_and_tok():
    import lynx_hf

    torch.manual_seed(0)
    return lynx_hf.load_default_model()


@pytest.fixture(scope="session")
def shakespeare_ids(model_and_tok):
    _, tok = model_and_tok
    return tok((FIXTURES / "shakespeare.txt").read_text(), return_tensors="pt").input_ids


@pytest.fixture(scope="session")
def questions():
    from lynx_hf.eval.lib.data import read_questions

    return read_questions(FIXTURES / "mmlu_pro.jsonl")


@pytest.fixture(scope="session")
def eval_prompts(model_and_tok, shakespeare_ids, questions):
    """The 20 evaluation prompts (256–2048 tokens), built from the fixtures."""
    from lynx_hf.eval.lib.data import eval_prompts

    return eval_prompts(model_and_tok[1], shakespeare_ids, questions)


def wait_until(condition, timeout: float = 20.0) -> bool:
    """Poll `condition` until it holds (a state to reach, not a time to pass); False at the timeout."""
    import time

    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.01)
    return True


def make_tiny(**config):
    """A 2-layer Llama with seeded weights (scaled so its outputs are decisive): the same model in every process."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shape, **config})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m


@pytest.fixture(scope="session")
def tiny():
    return make_tiny()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 / localhost, made with the openssl command."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True, timeout=60)
    return str(d / "cert.pem"), str(d / "key.pem")


LOOPBACK_SECRET = "loopback-secret"


def tiny_ids(n: int, seed: int) -> list[int]:
    """n token ids of the tiny model's vocabulary (3..95: no special ids), seeded."""
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture()
def loopback_server(tiny):
    """A prefill server for the tiny model in this process (a 16 MB prefix cache), closed after the test."""
    from lynx_hf.transfer import server as S

    srv = S.PrefillServer(tiny, secret=LOOPBACK_SECRET, prefix_cache_mb=16).start()
    yield srv
    srv.close()
