"""When to take another draft step: never once the residual is in, nor when it is due before another step would
end (the loader's `residual_eta`, against the measured step time)."""
from __future__ import annotations


class DraftPolicy:
    def __init__(self, cache):
        self.cache = cache
        self.step_s: float | None = None  # moving average of one draft step's wall time

    def another_step(self) -> bool:
        if self.cache.residual_ready():
            return False
        eta = self.cache.residual_eta()
        return eta is None or self.step_s is None or eta > self.step_s

    def stepped(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.5 * (self.step_s + seconds)
