"""Is the Hugging Face hub reachable? Asked once per process, in a few seconds.

Offline, the hub libraries retry for ~30 s before failing. The scripts ask first: if the
hub can't be reached, every later hub call of the process reads the local cache only
(HF_HUB_OFFLINE), and what is not cached fails at once with a line that says why."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub answers a TCP connection; if not, switch this process to the cache."""
    from huggingface_hub import constants

    reachable = False
    if not constants.HF_HUB_OFFLINE:
        url = urlparse(constants.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
            reachable = True
        except OSError:
            pass
    if not reachable:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True  # read at import time by the hub library
    return reachable
