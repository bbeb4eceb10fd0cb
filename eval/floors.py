"""The floors and rounds arithmetic lives in the core (lynx_hf/floors.py: the vLLM harnesses use it too, and the
core never imports eval); its names stay importable from here."""
from lynx_hf.floors import (PASS_GAP_S, floors, last_arrival, median_step, paired, passes,  # noqa: F401
                            rotated, second_token_data, spread, step_s)
