"""miles.rollout imports no Ray (DESIGN.md's layers): engine servers on Ray actors are started by an
`EngineLauncher` the ray layer passes in (miles.ray.engine_launcher), never imported from here."""

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import miles.rollout
for m in pkgutil.walk_packages(miles.rollout.__path__, "miles.rollout."):
    importlib.import_module(m.name)
print(sorted(k for k in sys.modules if k == "ray" or k.startswith(("ray.", "miles.ray"))))
"""


def test_importing_every_rollout_module_loads_no_ray():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
