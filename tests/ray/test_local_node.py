"""The private local Ray node a run starts: no idle workers beside the run's own actors, actors at the
driver's CPU priority, no Ray metrics.

Ray pre-starts one Python worker per CPU for the first driver; none can host a miles actor (they
lack the job's runtime environment), so each was only memory (~85 MB) and start-up CPU. Ray starts
its workers at nice 15, so the run's actors lost the CPU to anything at nice 0 (the driver, Ray's
own processes, the rest of the machine). The run's node (`miles.ray.cluster.ray_session`) is
started in a subprocess here, as `miles train` starts it (its own process tree), and its processes
are listed once an actor has answered.
"""

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json, os, time, types
    import psutil, ray
    from miles.ray.cluster import ray_session

    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(ray_address=None))
    with ray_session(cfg, {}, num_cpus=2):
        @ray.remote
        class Probe:
            def pid(self):
                return os.getpid()

            def nice(self):
                return os.nice(0)

        probe = Probe.options(num_cpus=0.5).remote()  # held: an actor without a handle is ended
        actor_pid = ray.get(probe.pid.remote(), timeout=120)
        nice = {"driver": os.nice(0), "actor": ray.get(probe.nice.remote(), timeout=60)}
        from ray._private.state import state
        metrics = state.get_system_config().get("enable_metrics_collection")  # what the node's GCS runs with
        time.sleep(3)  # pre-started workers come up within a second or two of the driver connecting
        names = []
        for p in psutil.Process().children(recursive=True):
            try:
                names.append((p.pid, " ".join(p.cmdline())))
            except psutil.Error:
                pass
    print(json.dumps({"actor": actor_pid, "procs": names, "nice": nice, "metrics": metrics}))
""")


def test_the_local_node_starts_no_idle_workers_and_still_hosts_actors():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Workers name themselves ray::<actor> or ray::IDLE; Ray's node agents also take the prefix.
    agents = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
    workers = [(pid, cmd.split()[0]) for pid, cmd in got["procs"] if cmd.startswith("ray::") and not cmd.startswith(agents)]
    # The actor's own worker is there; no other Python worker (idle or otherwise) is.
    assert workers == [(got["actor"], "ray::Probe")], workers
    # The actor runs at the driver's priority (Ray's default is nice 15), and the node records no Ray metrics.
    assert got["nice"]["actor"] == got["nice"]["driver"], got["nice"]
    assert got["metrics"] is False
