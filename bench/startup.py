"""Where the start of a default run goes: launch to the first RL step, split into its phases.

    python bench/startup.py                 # the phases once each, then one real `miles full-train --num-rollout 1`
    python bench/startup.py --repeats 3     # medians of 3 fresh runs of each phase, interleaved
    python bench/startup.py --tiny          # the smoke test: one repeat, a 2-step SFT warm start

A default run starts in this order (miles/ray/driver.py, miles/ray/cluster.py): the CLI and the
recipe's prepare checks (sentinels, no work once prepared); a private Ray node (`ray.init`: GCS,
raylet, Ray's own agent processes); the placement group; the rollout manager and trainer actors, side
by side, each a fresh worker process that imports torch and Hugging Face's Qwen3 code and loads the
model (the manager also its engine and datasets; the trainer its optimizer); the tracker (MLflow's
store, prepared on a thread meanwhile); the first weight sync and the eval before training; step 1.

Each phase is timed here in fresh processes of its own, one phase at a time, so the numbers are what
each costs alone (in the real run the actors' set-ups overlap and everything shares the cores); the
last row is the real run's launch to the end of step 1, eval excluded, measured as bench/vs_trl.py
measures it. TRL's side of the same start is one process: `import torch, transformers` and the
model's `from_pretrained` (plus `import trl` when the bench extra is installed), timed the same way.
Every phase row is seconds and the load average it ran at; nothing is a ratio against a goal here
(the goals, start-up <= 1x TRL's and peak RSS <= 2x, are bench/vs_trl.py's rows). The real run also
gives its memory: the peak RSS of its process tree (summed as bench/vs_trl.py sums it) and each
process's own peak by role (driver, each actor, each of Ray's processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each phase: a fresh interpreter runs the snippet, which prints the seconds it measured on its last
# line ("whole" = the interpreter's wall time from launch, imports included).
_CFG = """
from recipes import tiny_qwen3
from miles.config.resolve import build_config, resolve
opts = tiny_qwen3.Options(output_dir=W + "/runs", model_dir=W + "/models", data_dir=W + "/data", run_id="startup", sft_steps=SFT)
cfg = resolve(build_config(dict(tiny_qwen3.plan(opts).engine), environ={}))
"""
PHASES: dict[str, str] = {
    "import ray (the driver and every actor process)": "import time; t = time.perf_counter(); import ray; print(time.perf_counter() - t)",
    "ray.init: a private local node": textwrap.dedent("""
        import time, types, ray
        from miles.ray.cluster import ray_session
        t = time.perf_counter()
        with ray_session(types.SimpleNamespace(cluster=types.SimpleNamespace(ray_address=None)), {}, num_cpus=2):  # as a run starts it
            t1 = time.perf_counter()
            @ray.remote
            class Empty:
                def ping(self): return 1
            ray.get(Empty.options(num_cpus=0.5).remote().ping.remote())
            print(t1 - t, time.perf_counter() - t1)
    """),
    "import torch": "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)",
    "import Hugging Face's Qwen3 model code (after torch)": textwrap.dedent("""
        import time, torch
        t = time.perf_counter()
        import transformers.models.qwen3.modeling_qwen3
        print(time.perf_counter() - t)
    """),
    "rollout manager set-up (engine, datasets; imports included)": _CFG + textwrap.dedent("""
        import time
        t = time.perf_counter()
        from miles.ray.rollout_manager import RolloutManager
        RolloutManager(cfg)
        print(time.perf_counter() - t)
    """),
    "trainer set-up (model, optimizer; imports included)": _CFG + textwrap.dedent("""
        import time
        t = time.perf_counter()
        from miles.ray.train_group import TrainWorker
        TrainWorker(cfg, rank=0, world_size=1, device="cpu").start("127.0.0.1", 0)
        print(time.perf_counter() - t)
    """),
    "TRL's process: import torch, transformers (and trl) + from_pretrained": _CFG + textwrap.dedent("""
        import importlib.util, time
        t = time.perf_counter()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if importlib.util.find_spec("trl") is not None:
            import trl  # noqa: F401
        AutoTokenizer.from_pretrained(cfg.rollout.hf_checkpoint)
        AutoModelForCausalLM.from_pretrained(cfg.rollout.hf_checkpoint, dtype=torch.float32)
        print(time.perf_counter() - t)
    """),
}


def load() -> float:
    return os.getloadavg()[0]


def run_phase(snippet: str, work: Path, sft_steps: int) -> tuple[float, list[float]]:
    """(the interpreter's whole wall time, the seconds the snippet printed)."""
    code = f"W = {str(work)!r}; SFT = {sft_steps}\n" + snippet
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    whole = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"a start-up phase failed:\n{r.stderr[-3000:]}")
    return whole, [float(x) for x in r.stdout.strip().splitlines()[-1].split()]


def _role(proc) -> str:
    """What a process of the run's tree is: the driver, an actor (`ray::Class`), or one of Ray's own."""
    cmd = proc.cmdline() or ["?"]
    if cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0]  # ray::TrainWorkerActor.train -> the actor, whatever it runs now
    line = " ".join(cmd)
    for marker, name in (("log_monitor.py", "Ray log monitor"), ("autoscaler", "Ray autoscaler monitor"),
                         ("dashboard.py", "Ray dashboard"), ("gcs_server", "Ray GCS"), ("raylet", "Ray raylet"),
                         ("runtime_env/agent/main.py", "ray::RuntimeEnvAgent"), ("dashboard/agent.py", "ray::DashboardAgent"),
                         ("torch_shm_manager", "torch_shm_manager"), ("miles_cli", "driver")):
        if marker in line:
            return name
    return line[:40]


class TreeRss:
    """Samples the RSS of a process and its descendants every 0.2 s: the peak of their sum (what
    bench/vs_trl.py reports) and each process's own peak, by role."""

    def __init__(self, pid: int):
        import threading

        import psutil

        self._root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._by_pid: dict[int, tuple[str, int]] = {}  # pid -> (its latest role: workers rename themselves, its peak)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    rss, role = p.memory_info().rss, _role(p)
                except psutil.Error:
                    continue
                total += rss
                self._by_pid[p.pid] = (role, max(self._by_pid.get(p.pid, ("", 0))[1], rss))
            self.peak = max(self.peak, total)

    @property
    def by_role(self) -> dict[str, int]:
        """Each role's peak RSS (the largest of its processes, e.g. of two training ranks)."""
        out: dict[str, int] = {}
        for role, peak in self._by_pid.values():
            out[role] = max(out.get(role, 0), peak)
        return out

    def stop(self) -> int:
        """Stop sampling; the tree's peak RSS."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def real_start(work: Path, sft_steps: int) -> tuple[float, TreeRss]:
    """Launch of `miles full-train --num-rollout 1` (prepared) to the end of step 1, the eval before it
    excluded; and the run's memory (the peak RSS of its process tree, and of each process)."""
    name = "startup-real"
    cmd = [sys.executable, "-m", "miles_cli.main", "full-train", "--output-dir", str(work / "runs"), "--model-dir", str(work / "models"),
           "--data-dir", str(work / "data"), "--run-id", name, "--sft-steps", str(sft_steps), "--extra-args", "--num-rollout 1"]
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = TreeRss(proc.pid)
    out, _ = proc.communicate(timeout=1200)
    rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"miles full-train failed:\n{out[-4000:]}")
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    eval0 = sum(x.get("perf/eval_time", 0.0) for x in rows if x["step"] == 0)
    return min(x["time"] for x in rows if x["step"] == 1 and "perf/step_time" in x) - launched - eval0, rss


def prepare(work: Path, sft_steps: int) -> None:
    from miles.prepare.runner import run_prepare_steps
    from recipes import tiny_qwen3

    opts = tiny_qwen3.Options(output_dir=str(work / "runs"), model_dir=str(work / "models"), data_dir=str(work / "data"),
                              run_id="startup", sft_steps=sft_steps)
    run_prepare_steps(tiny_qwen3.plan(opts).prepare)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="fresh runs of each phase (interleaved); medians are reported")
    ap.add_argument("--no-real-run", action="store_true", help="skip the real `miles full-train --num-rollout 1`")
    ap.add_argument("--work", type=Path, default=None, help="prepare the recipe's inputs here (kept) instead of a temporary folder")
    ap.add_argument("--tiny", action="store_true", help="one repeat, the debug recipe's 2-step SFT warm start (the smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here (bench/run_all.py reads it)")
    a = ap.parse_args()
    if a.repeats < 1:
        print(f"--repeats {a.repeats}: give at least 1.", file=sys.stderr)
        return 2
    sft_steps, repeats = (2, 1) if a.tiny else (375, a.repeats)
    got: dict[str, list[list[float]]] = {k: [] for k in PHASES}
    loads: dict[str, list[float]] = {k: [] for k in PHASES}
    with tempfile.TemporaryDirectory(prefix="miles-startup-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(work, sft_steps)
        for _ in range(repeats):
            for name, snippet in PHASES.items():
                loads[name].append(load())
                whole, parts = run_phase(snippet, work, sft_steps)
                got[name].append([whole, *parts])
        real = None if a.no_real_run else (load(), *real_start(work, sft_steps), load())
    rows: list[dict] = []
    print(f"\n{'phase (each alone, fresh processes)':66} {'seconds':>8} {'process':>8} {'load':>5}")
    for name in PHASES:
        med = [statistics.median(col) for col in zip(*got[name])]
        whole, parts = med[0], med[1:]
        if name.startswith("ray.init"):
            shown = [("ray.init: a private local node", parts[0]), ("first actor on it: worker process start + one call", parts[1])]
        else:
            shown = [(name, parts[0])]
        for what, value in shown:
            print(f"{what:66} {value:8.2f} {whole:8.2f} {statistics.median(loads[name]):5.1f}")
            rows.append({"what": f"start-up: {what}", "value": value, "unit": "s", "goal": "", "met": None,
                         "process_s": whole, "load": statistics.median(loads[name])})
    if real is not None:
        at, seconds, rss, end = real
        print(f"{'real run: launch to the end of step 1 (eval excluded)':66} {seconds:8.2f} {'':8} {at:5.1f}")
        rows.append({"what": "start-up: real run, launch to the end of step 1", "value": seconds, "unit": "s", "goal": "", "met": None,
                     "load": at, "load_end": end})
        print(f"\nreal run: peak RSS of the process tree {rss.peak / 1e9:.2f} GB; each process's own peak (MB):")
        for role, peak in sorted(rss.by_role.items(), key=lambda kv: -kv[1]):
            print(f"  {role:64} {peak / 1e6:8.0f}")
        rows.append({"what": "start-up: real run, peak RSS of the process tree", "value": rss.peak / 1e9, "unit": "GB", "goal": "",
                     "met": None, "load": at, "by_process_mb": {k: round(v / 1e6) for k, v in rss.by_role.items()}})
    if a.json:
        a.json.write_text(json.dumps({"bench": "startup", "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
