"""Pure FlowGRPO math: tensors in, tensors out. No Ray, no diffusers, no config objects."""

from app.algo.advantages import group_advantages
from app.algo.loss import flow_grpo_loss, transition_kl
from app.algo.sde import SDE_TYPES, SDEStepOutput, gaussian_log_prob, sde_step

__all__ = ["SDE_TYPES", "SDEStepOutput", "flow_grpo_loss", "gaussian_log_prob", "group_advantages", "sde_step",
           "transition_kl"]
