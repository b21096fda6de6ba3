"""The controller state machine with layer-wise load-back on: every rule (acquire with host and storage
hits, serve, evict, cancel, storage faults, close) runs while loads land layer by layer in tasks of their
own. Before each step's checks the machine waits for the loads in flight (a reader waits per layer; the
checks read whole pages), then the same exact accounting and content checks hold, for both refill
policies."""

from __future__ import annotations

import dataclasses

import anyio
from cache_internals import layered_loader_of
from hypothesis import HealthCheck, event, settings
from test_controller_state_machine import ControllerMachine

from hicache import HiCacheConfig, KVLayout
from hicache.policy import StopPolicy, WritePolicy


class LayerwiseControllerMachine(ControllerMachine):
    """`ControllerMachine` over a cache that loads host hits back layer by layer."""

    def cache_config(self, layout: KVLayout, write: WritePolicy, stop: StopPolicy) -> HiCacheConfig:
        return dataclasses.replace(super().cache_config(layout, write, stop), layerwise_load_back=True)

    async def check(self) -> None:
        loader = layered_loader_of(self.c)
        if loader.in_flight:
            event("a layer-wise load in flight at the end of a step")
        with anyio.fail_after(30):
            while loader.in_flight or loader._tasks:  # noqa: ASYNC110 - the copy runs in a worker thread
                await anyio.sleep(0.001)
        await super().check()


class LayerwiseRescueControllerMachine(LayerwiseControllerMachine):
    """The layer-wise machine with `refill_under_unbacked="backup_then_attach"`."""

    refill_policy = "backup_then_attach"


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LayerwiseControllerMachine.TestCase.settings = _settings
LayerwiseRescueControllerMachine.TestCase.settings = _settings
test_controller_machine_layerwise = LayerwiseControllerMachine.TestCase
test_controller_machine_layerwise_rescue = LayerwiseRescueControllerMachine.TestCase
