"""SGLang rollout backend: the pinned versions, the `ServerArgs`/router field snapshots, the launcher.

- `SGLANG_VERSION`, `SGLANG_ROUTER_VERSION`: the one SGLang release miles is built against. The
  docker images, `requirements/gpu.txt` and the field snapshots all name this version; a test checks
  that they agree (tests/rollout/test_sglang_install.py).
- `snapshot`: the checked-in list of SGLang `ServerArgs` and sglang-router `RouterArgs` fields
  (`server_args.json`, `router_args.json`) from which the `--sglang-*` and `--sglang-router-*`
  options are generated; `python -m miles.rollout.sglang.snapshot` regenerates them from the pinned
  wheels without importing torch.
- `launch`: pure functions from a resolved config to the argv of each SGLang server and of the
  router, and the health wait (with a timeout) that the engine actors use.

Importing this package is free: no torch, no sglang.
"""

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"
