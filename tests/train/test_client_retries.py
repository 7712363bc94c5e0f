"""The trainer's recovery paths, which a healthy run never takes: a group whose replica failed is asked again
(a rejected request is not), a reward that fails or answers with the wrong shape is asked again and then fails
the step naming the group, and a group sampled by another adapter version is regenerated after re-publishing.

`StubRollout`/`StubReward` stand in for Serve DeploymentHandles (same `.method.remote(...)` awaitable shape) so that
failures can be injected at exact calls; real replicas die in tests/test_fault_tolerance.py, and a real Serve
reward deployment that fails in tests/deployments/test_failing_reward.py."""

import asyncio
from types import SimpleNamespace

import pytest

from app.rewards import RewardScores
from app.rollout.client import BlockingRolloutClient, GroupFailed, RolloutClient, ScoredGroup


class _Method:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def remote(self, *args):
        self.calls += 1

        async def call():
            await asyncio.sleep(0)
            return self.fn(*args)
        return call()


def trajectory(request, version=0):
    return SimpleNamespace(images=[request.group_id] * 2, prompt=request.prompt, group_size=2,
                           lora_version=version, group_id=request.group_id)


class StubRollout:
    def __init__(self, fn):
        self.generate = _Method(fn)


class StubReward:
    def __init__(self, fn=None):
        self.score = _Method(fn or (lambda images, prompts: RewardScores(total=[float(len(p)) for p in prompts])))


def requests(k):
    return [SimpleNamespace(group_id=i, prompt=f"prompt {i}") for i in range(k)]


def test_a_failed_group_is_asked_again_and_arrives_in_request_order():
    failures = {1: 1}  # group 1's replica dies the first time

    def flaky(request):
        if failures.get(request.group_id, 0) > 0:
            failures[request.group_id] -= 1
            raise RuntimeError("ActorDiedError: replica lost")
        return trajectory(request)

    rollout = StubRollout(flaky)
    groups = asyncio.run(RolloutClient(rollout, StubReward(), retries=2, retry_delay_s=0).collect(requests(3)))
    assert [g.trajectory.group_id for g in groups] == [0, 1, 2] and [g.index for g in groups] == [0, 1, 2]
    assert rollout.generate.calls == 4 and groups[1].rewards.total == [8.0, 8.0]
    assert [g.retries for g in groups] == [0, 1, 0]


def test_a_rejected_request_is_not_retried():
    def reject(request):
        raise ValueError("height must be a multiple of 16")

    rollout = StubRollout(reject)
    with pytest.raises(ValueError, match="multiple of 16"):
        asyncio.run(RolloutClient(rollout, StubReward(), retries=3, retry_delay_s=0).collect(requests(1)))
    assert rollout.generate.calls == 1


def test_retries_are_bounded():
    def dead(request):
        raise RuntimeError("replica lost")

    rollout = StubRollout(dead)
    with pytest.raises(GroupFailed, match=r"group 0 \('prompt 0'\): generation failed 3 times.*replica lost"):
        asyncio.run(RolloutClient(rollout, StubReward(), retries=2, retry_delay_s=0).collect(requests(1)))
    assert rollout.generate.calls == 3


@pytest.mark.parametrize("answer, why", [
    (lambda images, prompts: RewardScores(total=[1.0]), "1.*scores for 2 images"),  # wrong length
    (lambda images, prompts: RewardScores(total=[1.0, 2.0], components={"ocr": [1.0]}), "scores for 2 images"),
    (lambda images, prompts: RewardScores(total=[1.0, float("nan")]), "not a finite number"),
    (lambda images, prompts: [1.0, 2.0], "list, not RewardScores"),
    (lambda images, prompts: 1 / 0, "ZeroDivisionError"),  # the reward raised
])
def test_a_reward_that_cannot_be_computed_is_retried_then_fails_naming_the_group(answer, why):
    reward = StubReward(answer)
    rollout = StubRollout(trajectory)
    client = RolloutClient(rollout, reward, retries=2, retry_delay_s=0)
    with pytest.raises(GroupFailed, match=rf"group 0 \('prompt 0'\): reward failed 3 times.*{why}"):
        asyncio.run(client.collect(requests(1)))
    assert rollout.generate.calls == 1 and reward.score.calls == 3  # the images were fine: only the reward again


def test_a_reward_that_fails_once_is_asked_again_without_regenerating():
    calls = []

    def flaky(images, prompts):
        calls.append(prompts[0])
        if len(calls) == 1:
            raise RuntimeError("ActorDiedError: reward replica lost")
        return RewardScores(total=[2.0, 3.0])

    rollout = StubRollout(trajectory)
    (group,) = asyncio.run(RolloutClient(rollout, StubReward(flaky), retries=2, retry_delay_s=0).collect(requests(1)))
    assert group.rewards.total == [2.0, 3.0] and group.retries == 1 and rollout.generate.calls == 1


class RecordingClient(RolloutClient):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.published = []

    async def publish(self, adapter):
        self.published.append(adapter.version)


def versioned(k, version):
    return [SimpleNamespace(group_id=i, prompt=f"prompt {i}", lora_version=version) for i in range(k)]


def test_a_group_from_another_adapter_is_regenerated_after_republishing():
    first = {2}  # group 2 first lands on a replica that came back on the base model

    def restarted_replica(request):
        version = 0 if request.group_id in first else 5
        first.discard(request.group_id)
        return trajectory(request, version=version)

    rollout = StubRollout(restarted_replica)
    client = RecordingClient(rollout, StubReward(), retries=0, retry_delay_s=0)
    with BlockingRolloutClient(client) as blocking:  # the trainer's synchronous way in
        groups, regenerated = blocking.collect_on_policy(versioned(3, 5), SimpleNamespace(version=5))
    assert regenerated == 1 and client.published == [5] and rollout.generate.calls == 4
    assert [g.trajectory.lora_version for g in groups] == [5, 5, 5]
    assert [g.trajectory.group_id for g in groups] == [0, 1, 2]


def test_a_group_still_off_policy_after_republishing_stops_the_step():
    client = RecordingClient(StubRollout(lambda request: trajectory(request, version=3)), StubReward(), retries=0,
                             retry_delay_s=0)
    with pytest.raises(RuntimeError, match="group 0 .*adapter version 3 after publishing version 5 again"):
        asyncio.run(client.collect_on_policy(versioned(2, 5), SimpleNamespace(version=5)))


def test_requests_must_ask_for_the_adapter_given():
    client = RecordingClient(StubRollout(trajectory), StubReward(), retries=0, retry_delay_s=0)
    with pytest.raises(ValueError, match="adapter version 0"):
        asyncio.run(client.collect_on_policy(versioned(2, 5), None))


def test_pipelined_groups_more_than_k_versions_old_are_regenerated_with_the_current_adapter():
    """Pipelined training at adapter version 5 with max_staleness 1: groups of versions 5 and 4 are trained as
    they are; a group of version 3 (two behind) and one of version 6 (a version this policy never had: a replica
    still serving another run's adapter) are generated again, asking for version 5 by name."""
    sampled = {0: 5, 1: 4, 2: 3, 3: 6}
    asked = []

    def replica(request):
        asked.append((request.group_id, request.lora_version))
        return trajectory(request, version=request.lora_version)

    unpinned = [SimpleNamespace(group_id=i, prompt=f"prompt {i}", lora_version=None,
                                replace=lambda i=i, **kw: SimpleNamespace(group_id=i, prompt=f"prompt {i}", **kw))
                for i in range(4)]
    client = RecordingClient(StubRollout(replica), StubReward(), retries=0, retry_delay_s=0)
    first = [ScoredGroup(i, trajectory(r, version=sampled[i]), RewardScores(total=[0.0, 0.0]), 0.0, 0.0)
             for i, r in enumerate(unpinned)]
    with BlockingRolloutClient(client) as blocking:
        groups, regenerated = blocking.refresh(first, unpinned, SimpleNamespace(version=5), max_staleness=1)
    assert regenerated == 2 and client.published == [5] and sorted(asked) == [(2, 5), (3, 5)]
    assert [g.trajectory.lora_version for g in groups] == [5, 4, 5, 5]
    assert groups[1] is first[1] and groups[2] is not first[2]  # the stale one is replaced, never returned
    with BlockingRolloutClient(client) as blocking:  # on-policy (k = 0): only version 5 stays
        _, regenerated = blocking.refresh(first, unpinned, SimpleNamespace(version=5), max_staleness=0)
    assert regenerated == 3


def test_collect_ahead_runs_while_the_caller_works_and_close_cancels_what_is_left():
    import threading

    release = threading.Event()

    def slow(request):
        if request.group_id == 1:
            release.wait(timeout=30)  # group 1 generates until the caller lets it finish
        return trajectory(request)

    client = RolloutClient(StubRollout(slow), StubReward(), retries=0, retry_delay_s=0)
    blocking = BlockingRolloutClient(client)
    ahead = blocking.collect_ahead(requests(2))
    assert not ahead.done()  # the caller goes on (trains) while the groups generate
    release.set()
    assert [g.trajectory.group_id for g in ahead.result(timeout=30)] == [0, 1]

    async def forever(request):  # a group still generating when the run ends
        await asyncio.sleep(3600)

    client.rollout = SimpleNamespace(generate=SimpleNamespace(remote=forever))
    never = blocking.collect_ahead(requests(1))
    blocking.close()
    assert never.cancelled()
