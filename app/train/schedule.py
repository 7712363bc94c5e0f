"""When a step's groups are generated, and how a new adapter reaches the replicas: the rollout schedule of one
training worker (`train.max_staleness`).

On-policy (k = 0): a step asks for its groups now, each pinned to the adapter published last, and its publication
waits until every live replica serves the new adapter (then a barrier: no worker asks for the next step's groups
before that).

Pipelined (k >= 1): the groups of steps +1 .. +k are generated while a step trains, each trajectory recording the
version that sampled it; a group more than k versions behind the policy is generated again with the current
adapter. Publication goes on in the background and nobody waits for it: the groups requested next are pinned to
the adapter just published, so a replica the broadcast has not reached reads it from the adapter store first
(`RolloutClient.collect_after`), and a publication waits only for the one before it.

Ray Train-free (the loop passes a `BlockingRolloutClient`); `torch.distributed` only for the barriers.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch.distributed as dist

from app.config import RunConfig
from app.rollout.client import BlockingRolloutClient, Publication, ScoredGroup
from app.train.prompts import group_request, step_prompts
from app.types import GenerationRequest, LoraAdapter


class OnPolicySchedule:
    def __init__(self, config: RunConfig, rollout: BlockingRolloutClient, prompts: list[str], *, rank: int,
                 world: int):
        self.config, self.rollout, self.prompts, self.rank, self.world = config, rollout, prompts, rank, world
        self.publication_s = 0.0  # rank 0: the last publication's seconds until every replica served it

    def requests(self, step: int, version: int | None) -> list[GenerationRequest]:
        """This worker's groups of step `step`: the step's groups dealt round-robin to the workers, pinned to
        adapter `version` (None: unpinned)."""
        cfg, train = self.config, self.config.train
        mine = step_prompts(self.prompts, step, train.groups_per_step, seed=train.seed,
                            shuffle=cfg.data.shuffle)[self.rank::self.world]
        return [group_request(cfg.rollout, prompt, g, seed=train.seed, step=step, lora_version=version)
                for g, prompt in mine]

    def groups(self, step: int, adapter: LoraAdapter | None, version: int) -> tuple[list[ScoredGroup], int]:
        """Step `step`'s scored groups in request order, sampled with `adapter` (version `version`), and how many
        had to be generated again."""
        return self.rollout.collect_on_policy(self.requests(step, version), adapter)

    def before_training(self, step: int, version: int) -> int:
        """What must happen between collecting a step's groups (the policy at `version`) and training on them;
        replicas lost meanwhile."""
        return 0

    def publish(self, adapter: LoraAdapter) -> int:
        """Serve `adapter` from now on (a collective); the replicas that died before loading it (rank 0 counts)."""
        lost = self._published(self.rollout.publish(adapter)) if self.rank == 0 else 0
        dist.barrier()
        return lost

    def _published(self, publication: Publication) -> int:
        self.publication_s = publication.seconds
        return publication.lost

    def finish(self) -> None:
        """The replicas serve the final adapter when this returns."""


class PipelinedSchedule(OnPolicySchedule):
    def __init__(self, config: RunConfig, rollout: BlockingRolloutClient, prompts: list[str], *, rank: int,
                 world: int):
        super().__init__(config, rollout, prompts, rank=rank, world=world)
        self.ahead: dict[int, Future] = {}  # step -> its groups, generating
        self.publishing: Future | None = None  # rank 0: the publication still on its way to the replicas

    def groups(self, step: int, adapter: LoraAdapter | None, version: int) -> tuple[list[ScoredGroup], int]:
        requests = self.requests(step, None)
        ahead = self.ahead.pop(step, None)  # none at the first step, or after a restart
        groups = (ahead if ahead is not None else self.rollout.collect_ahead(requests)).result()
        return self.rollout.refresh(groups, requests, adapter, max_staleness=self.config.train.max_staleness)

    def before_training(self, step: int, version: int) -> int:
        """Request the groups of steps step+1 .. step+k not yet requested (the run's steps only), to generate while
        this one trains, sampled with adapter `version` (the one published last, maybe still on its way) or later."""
        lost = self._settle(wait=False)
        train = self.config.train
        for ahead in range(step + 1, min(step + train.max_staleness, train.num_steps - 1) + 1):
            if ahead not in self.ahead:
                self.ahead[ahead] = self.rollout.collect_ahead(self.requests(ahead, None), after=version)
        return lost

    def publish(self, adapter: LoraAdapter) -> int:
        lost = 0
        if self.rank == 0:
            lost = self._settle(wait=True)  # one publication on its way at a time (long done, usually)
            self.publishing = self.rollout.publish_ahead(adapter)
        return lost

    def _settle(self, *, wait: bool) -> int:
        """The replicas lost by the last publication once it has landed (its error, if it failed), else 0."""
        if self.publishing is None or not (wait or self.publishing.done()):
            return 0
        publishing, self.publishing = self.publishing, None
        return self._published(publishing.result())

    def finish(self) -> None:
        self._settle(wait=True)


def rollout_schedule(config: RunConfig, rollout: BlockingRolloutClient, prompts: list[str], *, rank: int,
                     world: int) -> OnPolicySchedule:
    kind = PipelinedSchedule if config.train.max_staleness > 0 else OnPolicySchedule
    return kind(config, rollout, prompts, rank=rank, world=world)
