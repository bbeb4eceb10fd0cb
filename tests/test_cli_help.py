"""What a newcomer meets first, without a model: `lynx-hf --help` and every subcommand's help, data checked
before any model loads (one line with the way out), `lynx-hf eval` naming the model and device it records, and
`lynx-hf card` from any directory."""
import argparse
import json
import os
import subprocess
import sys

import pytest

import lynx_hf
from lynx_hf.cli import main


def _no_model(monkeypatch):
    monkeypatch.setattr(lynx_hf, "load_default_model", lambda *a, **k: pytest.fail("a model was loaded"))


def test_help_names_the_project_and_every_option_says_what_it_does(capsys):
    from lynx_hf.cli import build_parser

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "Lynx: progressive speculative quantization" in top and "argument parsing only" not in top
    (subs,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in subs.choices.items():
        assert sub.description, name
        for a in sub._actions:
            assert a.help, (name, a.option_strings or a.dest)
    with pytest.raises(SystemExit):
        main(["serve-prefill", "--help"])
    assert "(default: 128)" in capsys.readouterr().out  # defaults shown


def test_help_starts_without_torch():
    code = "import sys; from lynx_hf.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip().splitlines()[-1] == "False", p.stdout[-500:]


@pytest.mark.parametrize("argv, says", [
    (["codec-quality"], "pass --text FILE"),
    (["calibrate"], "pass --text FILE"),
    (["acceptance"], "LYNX_DATA"),
    (["results"], "LYNX_MMLU_PRO_PATH"),
    (["bench", "transfer"], "--prompts shakespeare"),
    (["codec-quality", "--text", "/no/such.txt"], "--text /no/such.txt: no such file"),
])
def test_commands_that_need_data_say_so_before_loading_a_model(monkeypatch, tmp_path, capsys, argv, says):
    _no_model(monkeypatch)
    monkeypatch.setenv("LYNX_DATA", str(tmp_path))  # a folder without the data
    monkeypatch.delenv("LYNX_MMLU_PRO_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    import lynx_hf.eval.lib.data as data

    monkeypatch.setattr(data, "data_dir", lambda: (_ for _ in ()).throw(FileNotFoundError("no shared data")))
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "tests/fixtures" in err or says in err, err


def test_eval_refuses_tasks_list_and_missing_mmlu_pro_data_at_once(monkeypatch, tmp_path):
    from lynx_hf.eval.lmeval import lm_eval_model
    import lynx_hf.eval.lib.data as data

    with pytest.raises(SystemExit, match="lynx-hf eval ls tasks"):
        lm_eval_model.cli(["--model", "lynx", "--tasks", "list"])
    monkeypatch.delenv("LYNX_MMLU_PRO_PATH", raising=False)
    monkeypatch.setattr(data, "data_dir", lambda: (_ for _ in ()).throw(FileNotFoundError("no shared data")))
    with pytest.raises(SystemExit, match="LYNX_MMLU_PRO_PATH"):
        lm_eval_model.cli(["--model", "lynx", "--tasks", "mmlu_pro_local", "--limit", "2"])


@pytest.mark.slow  # converts the embedded GGUF model once, if its cache is cold
def test_eval_records_the_models_name_and_the_device_that_runs(monkeypatch):
    """lm-eval names its output folder after `pretrained=` (else a random id) and records --device (else cuda:0)."""
    from lm_eval import __main__ as lm_main
    from lynx_hf.eval.lmeval import lm_eval_model
    from lynx_hf.model import EMBEDDED

    seen = {}
    monkeypatch.setattr(lm_main, "cli_evaluate", lambda: seen.setdefault("argv", list(sys.argv)))
    lm_eval_model.cli(["--model", "lynx", "--model_args", "kv=int8", "--tasks", "niah_single_1"])
    argv = seen["argv"]
    assert argv[argv.index("--model_args") + 1] == f"kv=int8,pretrained={EMBEDDED}"
    assert argv[argv.index("--device") + 1] in ("cpu", "cuda")
    assert os.path.isfile(os.path.join(json.loads(argv[argv.index("--metadata") + 1])["tokenizer"],
                                       "tokenizer.json"))  # what RULER sizes its prompts with
    seen.clear()
    lm_eval_model.cli(["--model", "lynx", "--model_args", "pretrained=org/name", "--device", "cpu", "--tasks", "x"])
    assert seen["argv"].count("--device") == 1 and "pretrained=org/name" in seen["argv"]


def test_card_works_from_any_directory(monkeypatch, tmp_path):
    from lynx_hf.eval.tools import card

    monkeypatch.chdir(tmp_path)
    resolved = card.resolve_results(card.DEFAULT_RESULTS)
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results.md")
    assert resolved == (checkout if os.path.exists(checkout) else None)
    assert card.resolve_results("") is None and card.resolve_results("mine.md") == "mine.md"
