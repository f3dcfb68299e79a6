"""scripts/gpu_smoke.sh: valid bash, and its CPU-possible part (`--cpu-only`: versions, model build,
the TP-2 SGLang argv, bucket names, rank layout, TP-2 syncs on built-in servers) passes here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_the_cpu_only_part_passes_with_one_line_per_check():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(SCRIPT), "--cpu-only"], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    checks = [line for line in r.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert len(checks) == 6 and all(c.startswith("ok") for c in checks), r.stdout
    assert r.stdout.rstrip().endswith("summary: every check passed")
    assert "--tp-size 2" in r.stdout and "rank offsets [1, 3]" in r.stdout
