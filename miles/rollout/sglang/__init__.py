"""SGLang rollout backend: the snapshot generator, the launcher, the server actors.

- `SGLANG_VERSION`, `SGLANG_ROUTER_VERSION`: the one SGLang release miles is built against, pinned in
  `miles.sglang_spec` (with the `ServerArgs`/router field snapshots, read by config and rollout alike).
- `snapshot`: `python -m miles.rollout.sglang.snapshot` regenerates the field snapshots
  (miles/sglang_spec/server_args.json, router_args.json) from the pinned wheels without importing torch.
- `launch`: pure functions from a resolved config to the argv of each SGLang server and of the
  router, and the health wait (with a timeout) that the engine actors use.

Importing this package is free: no torch, no sglang.
"""

from miles.sglang_spec import SGLANG_ROUTER_VERSION, SGLANG_VERSION  # noqa: F401
