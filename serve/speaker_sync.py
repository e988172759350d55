"""The speakers whose flow prefixes a server keeps, following a speakers store that other servers share.

Servers that share one store (Ray's replicas, with a folder or the store actor; processes over one folder)
each keep their own prefix jobs and holds (`PrefixJobs`): a speaker deleted or replaced through one of them
would stay held by the others, its prefix pinned in their caches ahead of every upload's for as long as they
run. So every `ServerSettings.speakers_sync` seconds an app compares the speakers its engine keeps with the
store: one gone is cancelled (its job stopped, its hold let go, the prefix its job computed dropped), one
replaced is submitted again with its new prompt. A change made through the app itself is followed at once
(`routes_speakers`).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.flow_prefix import prompt_key
from cosyvoice_runtime.speakers import shown_name

from .state import ServerState

log = logging.getLogger(__name__)


async def follow_store(state: ServerState) -> None:
    """One comparison of the speakers `state`'s engine keeps prefixes for with `state.speakers`."""
    jobs = state.engine.voice.prefix_jobs
    async with state.speaker_changes:  # no registration or deletion of this app's in between
        for name, key in jobs.speakers().items():
            speaker = await run_in_threadpool(state.speakers.get, name)
            if speaker is None:
                jobs.cancel(name)
                log.info("speaker %s is no longer registered: its flow prefix is let go", shown_name(name))
            elif prompt_key(speaker.features) != key:
                jobs.submit(name, speaker.features)
                log.info("speaker %s was registered again with another prompt: its flow prefix follows",
                         shown_name(name))


async def keep_following(state: ServerState, period: float) -> None:
    """`follow_store` every `period` seconds until cancelled; a store that cannot be read (a folder gone, the
    store actor restarting) is logged and read again at the next period."""
    while True:
        await asyncio.sleep(period)
        try:
            await follow_store(state)
        except Exception as e:  # the store's errors share no base class (OSError, Ray's, unpickling)
            log.warning("the speakers store could not be read to follow its changes: %s: %s",
                        type(e).__name__, e)
