"""The kvtier connector with its hooks timed, for benchmarks (not for serving).

``gpu_vllm_bench.py --profile-connector`` loads ``ProfiledKvtierConnector``
from this module (``kv_connector_module_path``) in vLLM's engine process.
Each vLLM hook call is timed with ``perf_counter``; the totals (seconds and
calls per hook and role) and the native thread ids of kvtier's own threads
(the client's event loop, the attach link) are written as JSON to
``$KVTIER_PROFILE_OUT.<pid>.<role>`` at most twice a second, so the driver
can subtract two readings around a phase and attribute the engine process's
per-thread CPU time to kvtier or to vLLM.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvtier.vllm.connector import KvtierConnector

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "get_block_ids_with_load_errors", "get_kv_connector_stats")


class ProfiledKvtierConnector(KvtierConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self._prof: dict[str, list[float]] = {h: [0.0, 0] for h in HOOKS}
        self._prof_role = str(getattr(role, "name", role)).lower()
        self._prof_written = 0.0
        super().__init__(vllm_config, role, kv_cache_config)

    def _prof_dump(self, force: bool = False) -> None:
        out = os.environ.get("KVTIER_PROFILE_OUT")
        now = time.monotonic()
        if not out or (not force and now - self._prof_written < 0.5):
            return
        self._prof_written = now
        threads = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("kvtier")}
        path = f"{out}.{os.getpid()}.{self._prof_role}"
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "role": self._prof_role, "main_tid": threading.main_thread().native_id,
                       "hooks": self._prof, "threads": threads, "at": time.time()}, f)
        os.replace(path + ".tmp", path)


def _timed(name: str) -> Any:
    orig = getattr(KvtierConnector, name)

    def hook(self: ProfiledKvtierConnector, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            acc = self._prof[name]
            acc[0] += time.perf_counter() - t
            acc[1] += 1
            if name in ("get_finished", "build_connector_meta"):
                self._prof_dump()

    hook.__name__ = name
    hook.__doc__ = orig.__doc__
    return hook


for _h in HOOKS:
    setattr(ProfiledKvtierConnector, _h, _timed(_h))
