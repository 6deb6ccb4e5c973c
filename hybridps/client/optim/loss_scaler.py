"""Loss scaling for fp16 training, with the semantics of ``torch.amp.GradScaler``.

Dynamic: the scale is multiplied by ``backoff_factor`` on an overflow (the step is skipped)
and by ``growth_factor`` after ``growth_interval`` clean steps in a row. Static: the scale
never changes (overflowing steps are still skipped). Overflow detection is the optimizer's
job (per chunk); this class only keeps and updates the scale.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridps.common.config import LossScaleConfig


@dataclasses.dataclass
class LossScaler:
    scale: float
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    dynamic: bool = True
    growth_tracker: int = 0
    skipped_steps: int = 0

    @classmethod
    def starting(cls, config: LossScaleConfig) -> LossScaler:
        """A scaler at the start of training, as ``config`` (``Config.loss_scale``) says."""
        return cls(
            scale=config.scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            min_scale=config.min_scale,
            dynamic=config.dynamic,
        )

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        if not self.dynamic:
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
