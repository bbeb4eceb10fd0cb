"""When to take another draft step: never once the residual is in, nor when it is due within
`SpecConfig.verify_lead` draft steps (`LynxCache.residual_eta` against the measured step time): the tree's verify
pass then starts early and runs each layer as its residual lands, so it overlaps the end of the transfer."""
from __future__ import annotations


class DraftPolicy:
    def __init__(self, cache):
        self.cache = cache
        self.step_s: float | None = None  # moving average of one draft step's wall time

    def another_step(self) -> bool:
        if self.cache.residual_ready():
            return False
        eta = self.cache.residual_eta()
        return eta is None or self.step_s is None or eta > self.step_s * self.lead

    @property
    def lead(self) -> float:
        return max(1.0, self.cache.spec_config.verify_lead)

    def stepped(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.5 * (self.step_s + seconds)
