"""A deterministic `custom_class` proposer for tests/vllm_mixed.py: prompt lookup (the continuation of the row's last
two tokens' latest earlier occurrence in the row), else the last token repeated, so vLLM's rejection sampler runs
every step. It installs lynx_hf's expand-kernel fix as LynxProposer does."""
import numpy as np

from lynx_hf.vllm.fixes import install_expand_fix


class EchoProposer:
    def __init__(self, vllm_config):
        install_expand_fix()
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **_):
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            seq = token_ids_cpu[i, :int(num_tokens_no_spec[i])]
            if not sampled or len(seq) < 3:
                out.append([])
                continue
            tail, drafts = seq[-2:], [int(seq[-1])] * self.k
            for j in range(len(seq) - 3, -1, -1):
                if np.array_equal(seq[j:j + 2], tail) and j + 2 < len(seq) - 2:
                    drafts = [int(t) for t in seq[j + 2:j + 2 + self.k]]
                    break
            out.append(drafts)
        return out

    def load_model(self, *args, **kwargs):
        pass
