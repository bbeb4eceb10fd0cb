"""When to take another draft step: never once the residual is in, nor when a step of the next frontier's size
would end within `SpecConfig.verify_lead` of those steps before the residual is due (`LynxCache.residual_eta`): the
verify pass then starts early and runs each layer as its residual lands, so it overlaps the end of the transfer.

A step's cost grows with the positions it runs (a tree's frontier; ~47 ms for one, ~78 ms for eight on the
default model at 1K context and two CPU cores): the policy fits cost = a + b·nodes to the steps it has timed (least
squares; the mean while it has seen one size only) and asks it for the next step's size."""
from __future__ import annotations


class DraftPolicy:
    def __init__(self, cache, verify_lead: float):
        self.cache, self.lead = cache, max(1.0, verify_lead)
        self.seen: list[tuple[int, float]] = []  # (nodes, seconds) of the steps so far
        self.stop: str | None = None             # why the last another_step said no: "residual" (in), "lead" (due soon)

    def another_step(self, nodes: int = 1) -> bool:
        if self.cache.residual_ready():
            self.stop = "residual"
            return False
        eta, cost = self.cache.residual_eta(), self.step_s(nodes)
        if eta is None or cost is None or eta > cost * self.lead:
            return True
        self.stop = "lead"
        return False

    def step_s(self, nodes: int) -> float | None:
        """Expected seconds of a step running `nodes` positions per row (None before the first step)."""
        if not self.seen:
            return None
        recent = self.seen[-16:]
        xs, ys = [n for n, _ in recent], [t for _, t in recent]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        vx = sum((x - mx) ** 2 for x in xs)
        if vx == 0:
            return my
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx)
        return my + b * (nodes - mx)

    def stepped(self, seconds: float, nodes: int = 1) -> None:
        self.seen.append((nodes, seconds))
