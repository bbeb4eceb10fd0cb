import os
from pathlib import Path

# Triton kernels run on CPU tensors through the interpreter here; this must be set before triton is imported.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
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
    from lynx_hf.eval.data import read_questions

    return read_questions(FIXTURES / "mmlu_pro.jsonl")


@pytest.fixture(scope="session")
def eval_prompts(model_and_tok, shakespeare_ids, questions):
    """The 20 evaluation prompts (256–2048 tokens), built from the fixtures."""
    from lynx_hf.eval.data import eval_prompts

    return eval_prompts(model_and_tok[1], shakespeare_ids, questions)
