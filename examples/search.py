"""A search-like tool with a sandbox limit and a timeout.

The model asks ``<tool>search: QUERY</tool>``; the tool (here a tiny in-memory corpus behind a
simulated network delay) runs at most ``--limit sandbox=K`` at a time across the producer, each
call within ``TOOL_TIMEOUT`` seconds (a timed-out call answers "no result", the episode goes on);
the whole episode is bounded by ``--episode-timeout``. While a search runs, the episode holds no
engine slot. On the CPU::

    rollstream demo --generate examples/search.py:generate --tool search --limit sandbox=4 \\
        --episode-timeout 60

``ROLLSTREAM_SEARCH_DELAY`` (seconds, default 0.05) sets the simulated delay of one search.
"""

from __future__ import annotations

import asyncio
import os
import re

from rollstream import Episode, Sample

TOOL_CALL = re.compile(r"<tool>search: ([^<]*)</tool>")
MAX_TURNS = 6
TOOL_TIMEOUT = 5.0
CORPUS = {
    "add": "Addition: the sum of two numbers, e.g. two plus three is five.",
    "multiply": "Multiplication: repeated addition, e.g. four times three is twelve.",
    "subtract": "Subtraction: the difference of two numbers.",
    "divide": "Division: how many times one number fits into another.",
}


async def search(query: str) -> str:
    """The corpus entry sharing the most words with ``query`` (after a simulated delay)."""
    await asyncio.sleep(float(os.environ.get("ROLLSTREAM_SEARCH_DELAY", "0.05")))
    words = set(re.findall(r"\w+", query.lower()))
    symbols = {"+": "add", "*": "multiply", "-": "subtract", "/": "divide"}
    words |= {name for symbol, name in symbols.items() if symbol in query}
    best = max(CORPUS, key=lambda key: (key in words, len(words & set(CORPUS[key].lower().split()))))
    return CORPUS[best]


async def generate(episode: Episode) -> Sample:
    for _ in range(MAX_TURNS):
        turn = await episode.generate()
        calls = TOOL_CALL.findall(turn.text)
        if not calls or turn.truncated or episode.room == 0:
            break
        async with episode.limit("sandbox"):  # at most K searches at once, producer-wide
            try:
                async with asyncio.timeout(TOOL_TIMEOUT):
                    result = await search(calls[-1])
            except TimeoutError:
                result = "no result (search timed out)"
        await episode.observe(f"<result>{result}</result>")
    return episode.sample
