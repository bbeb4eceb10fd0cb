import os

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


@pytest.fixture(scope="session")
def model_and_tok():
    import lynx_hf

    torch.manual_seed(0)
    return lynx_hf.load_default_model()


@pytest.fixture(scope="session")
def shakespeare_ids(model_and_tok):
    from lynx_hf.eval import data

    _, tok = model_and_tok
    text = data.shakespeare().read_text()[:8 * 4096 + 1000]
    return tok(text, return_tensors="pt").input_ids
