"""The Hub folder `lynx-hf card` writes stands alone: its `custom_generate/generate.py` runs in a Python that cannot
import lynx_hf (only torch and transformers, as a Hub user has them) and equals plain greedy `generate`."""
import json
import os
import subprocess
import sys

import pytest

from lynx_hf import LynxQuantConfig
from lynx_hf.hub_folder import flat_name, runtime_modules, write_custom_generate

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = """
import json, sys
class NoLynx:  # this Python has no lynx_hf, like a Hub user's
    def find_spec(self, name, path=None, target=None):
        if name == "lynx_hf" or name.startswith("lynx_hf."):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the folder must stand alone)")
sys.meta_path.insert(0, NoLynx())
sys.path.insert(0, {tests!r})
import torch
from conftest import make_tiny

class Drafts:  # a streamer that also sees drafts (the folder maps streamer= to lynx_streamer=)
    def __init__(self):
        self.final, self.provisional = [], 0
    def put(self, v):
        self.final.append(v.reshape(-1).tolist())
    def put_provisional(self, v):
        self.provisional += v.numel()
    def resolve_provisional(self, n):
        pass
    def end(self):
        pass

m = make_tiny()
ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(3))
plain = m.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
s = Drafts()
got = m.generate(ids, custom_generate={folder!r}, trust_remote_code=True, max_new_tokens=16, do_sample=False,
                 eos_token_id=None, streamer=s)
try:
    m.generate(ids, custom_generate={folder!r}, trust_remote_code=True, max_new_tokens=2, num_beams=2)
    beams = "accepted"
except ValueError as e:
    beams = str(e)
# a conversation goes on: turn 2 on the cache turn 1 returned, as with Transformers' own DynamicCache
from transformers import DynamicCache
more = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
o1 = m.generate(ids, custom_generate={folder!r}, trust_remote_code=True, max_new_tokens=8, do_sample=False,
                eos_token_id=None, return_dict_in_generate=True)
o2 = m.generate(torch.cat([o1.sequences, more], 1), custom_generate={folder!r}, trust_remote_code=True,
                cache=o1.cache, max_new_tokens=8, do_sample=False, eos_token_id=None)
dc = DynamicCache(config=m.config)
r1 = m.generate(ids, cache=dc, max_new_tokens=8, do_sample=False, eos_token_id=None)
r2 = m.generate(torch.cat([r1, more], 1), cache=dc, max_new_tokens=8, do_sample=False, eos_token_id=None)
print(json.dumps({{"equal": torch.equal(plain, got), "drafts": s.provisional, "beams": beams,
                  "turns": torch.equal(o1.sequences, r1) and torch.equal(o2, r2),
                  "lynx_loaded": any(k == "lynx_hf" or k.startswith("lynx_hf.") for k in sys.modules)}}))
"""


def test_the_runtime_is_flat_and_needs_only_torch_and_transformers(tmp_path):
    names = write_custom_generate(tmp_path, LynxQuantConfig(), 3)
    d = tmp_path / "custom_generate"
    assert sorted(os.listdir(d)) == sorted(names)
    assert (d / "requirements.txt").read_text().split() == [r for r in (d / "requirements.txt").read_text().split()
                                                          if r.startswith(("torch", "transformers"))]
    for f in names:
        if f.endswith(".py"):
            text = (d / f).read_text()
            assert "lynx_hf." not in "".join(l for l in text.splitlines(True)
                                             if l.lstrip().startswith(("from ", "import "))
                                             and "raise" not in l), f  # no import of the package left
    assert flat_name("lynx_hf.quant.lynx") == "lynx_quant_lynx" and "lynx_hf.kernels.cpu" not in runtime_modules()


@pytest.mark.slow  # a subprocess importing torch and transformers
def test_the_folder_generates_where_lynx_hf_cannot_be_imported(tmp_path):
    write_custom_generate(tmp_path, LynxQuantConfig(), 3)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH="")
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=TESTS, folder=str(tmp_path))], env=env,
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["equal"] and not r["lynx_loaded"]
    assert r["turns"]  # turn 2 on turn 1's returned cache = Transformers' multi-turn pattern
    assert r["drafts"] > 0  # it drafted on the anchor (residual after 3 steps) and verified
    assert "num_beams" in r["beams"] or "beam" in r["beams"], r["beams"]


def test_an_exact_config_travels_with_the_folder(tmp_path):
    """The Hub folder's runtime carries exact mode's correction codec, and its generate takes the exact config."""
    names = write_custom_generate(tmp_path, LynxQuantConfig(exact=True), 3)
    assert "lynx_quant_exact.py" in names and "lynx_hf.quant.exact" in runtime_modules()
    assert "'exact': True" in (tmp_path / "custom_generate" / "generate.py").read_text()
