"""The speakers whose flow prefixes a server keeps, following a speakers store that other servers share.

Servers that share one store (Ray's replicas, with a folder or the store actor; processes over one folder)
each keep their own prefix jobs and holds (`PrefixJobs`): a speaker deleted or replaced through one of them
would stay held by the others, its prefix pinned in their caches ahead of every upload's for as long as they
run, and one registered through one would be held by that one only, its first stream elsewhere as slow as an
upload's. So every `ServerSettings.speakers_sync` seconds an app compares the speakers its engine keeps with
the store: one gone is cancelled (its job stopped, its hold let go, the prefix its job computed dropped),
one replaced is submitted again with its new prompt, one new since the last comparison is submitted as if it
had been registered here. A change made through the app itself is followed at once (`routes_speakers`).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from cosyvoice_runtime.flow_prefix import prompt_key
from cosyvoice_runtime.speakers import shown_name

from .state import ServerState

log = logging.getLogger(__name__)


async def follow_store(state: ServerState, known: set[str]) -> set[str]:
    """One comparison of the speakers `state`'s engine keeps prefixes for with `state.speakers`, whose names
    were `known` at the last one (or when the app started: the speakers it left out for the prefix cache's
    budget are not new); the store's names now."""
    jobs = state.engine.voice.prefix_jobs
    async with state.speaker_changes:  # no registration or deletion of this app's in between
        names = set(await run_in_threadpool(state.speakers.names))
        kept = jobs.speakers()
        for name in sorted(kept.keys() | (names - known)):
            speaker = await run_in_threadpool(state.speakers.get, name)
            if speaker is None:
                if name in kept:
                    jobs.cancel(name)
                    log.info("speaker %s is no longer registered: its flow prefix is let go",
                             shown_name(name))
            elif name not in kept:
                if jobs.submit(name, speaker.features) is not None:  # None: beyond the cache's budget
                    log.info("speaker %s was registered through another server: its flow prefix is computed",
                             shown_name(name))
            elif prompt_key(speaker.features) != kept[name]:
                jobs.submit(name, speaker.features)
                log.info("speaker %s was registered again with another prompt: its flow prefix follows",
                         shown_name(name))
    return names


async def keep_following(state: ServerState, period: float, known: set[str]) -> None:
    """`follow_store` every `period` seconds until cancelled, from the store's names `known` at the app's
    start; a store that cannot be read (a folder gone, the store actor restarting) is logged and read again
    at the next period."""
    while True:
        await asyncio.sleep(period)
        try:
            known = await follow_store(state, known)
        except Exception as e:  # the store's errors share no base class (OSError, Ray's, unpickling)
            log.warning("the speakers store could not be read to follow its changes: %s: %s",
                        type(e).__name__, e)
