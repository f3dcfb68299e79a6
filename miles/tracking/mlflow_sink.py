"""MLflow sink (`--use-mlflow`): one MLflow run per miles run, resumed when the miles run resumes.

- Store: `--mlflow-tracking-uri` (or `$MLFLOW_TRACKING_URI`), else `sqlite:///<run_dir>/mlflow.db`,
  a local file that needs no server (mlflow 3.17's plain `./mlruns` directory store refuses to work
  without `MLFLOW_ALLOW_FILE_STORE=true`). Browse it with
  `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`.
- Which run: `--mlflow-run-id` when given (it must exist in the store); else the id recorded in
  `<run_dir>/mlflow_run_id.txt` by an earlier start of this miles run (so a resumed run continues
  its MLflow run; a recorded id the store does not know starts a new run, with a warning); else a
  new run named `--mlflow-run-name` (default: the miles run id) in experiment
  `--mlflow-experiment-name`. A reopened run is set back to RUNNING.
- Params: flattened (`data.rollout_batch_size`), stringified, cut to 6000 characters, logged once;
  on resume, params already in the run are skipped, and a value that changed is recorded as the tag
  `changed_param/<key>` (MLflow refuses to overwrite a param).
- Metrics: keys mapped by `miles.tracking.keys.mlflow_key`; two keys that map to the same name are
  reported once and the later one is not sent to MLflow (the JSONL file still has it).
- Resume (`resume_step=N`: steps >= N are about to be redone): the reopened run never holds a step
  twice. With a SQL store (the default sqlite file, or a database URI) the points at steps >= N are
  deleted first, so MLflow ends with the redone values, like metrics.jsonl. MLflow's API has no way
  to delete a point, so with any other store (a tracking server), or an `--mlflow-run-id` that is not
  the one this run directory recorded, a (metric, step) the run already holds is not sent again:
  those steps keep the values MLflow has, with a warning.

Uses `MlflowClient` (no global active run), so it never disturbs a caller's own mlflow usage.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking.keys import flatten_params, mlflow_key

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id.txt"
ARTIFACTS_DIR = "mlflow_artifacts"  # under the run directory, with the default store
_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
_PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def is_run_store(uri: str | None, run_dir: Path) -> bool:
    """Whether `uri` is the run's own store: none named, or the run directory's sqlite file.

    A resolved config always names a store (the option's derived default is that sqlite file), so
    "was a URI given" cannot tell a store the user named from the run's own."""
    if uri is None:
        return True
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return False
    return Path(uri[len(prefix):]).resolve() == (Path(run_dir) / "mlflow.db").resolve()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class MlflowSink:
    name = "mlflow"

    def __init__(
        self, cfg: TrackingConfig, *, run_dir: Path, run_id: str, params: Mapping[str, Any] | Any, resume_step: int | None = None
    ):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        # A new sqlite store logs its schema set-up ("Creating initial MLflow database tables...") at INFO
        # on the run's console; it is MLflow's housekeeping, not the user's business. Warnings still show.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)

        self.tracking_uri = cfg.mlflow_tracking_uri or default_tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._key_owner: dict[str, str] = {}
        self._reported: set[str] = set()
        self._held: set[tuple[str, int]] = set()  # (key, step) a reopened run already has and keeps
        id_file = Path(run_dir) / RUN_ID_FILE

        existing = None
        if cfg.mlflow_run_id:
            try:
                existing = self.client.get_run(cfg.mlflow_run_id)
            except MlflowException as e:
                raise UserError(
                    f"--mlflow-run-id {cfg.mlflow_run_id} is not a run in the MLflow store {self.tracking_uri} "
                    f"({e.error_code}); pass an existing run id or drop the flag.",
                    option="--mlflow-run-id",
                ) from None
        elif id_file.exists():
            recorded = id_file.read_text(encoding="utf-8").strip()
            try:
                existing = self.client.get_run(recorded)
            except MlflowException:
                log.warning(
                    "%s names MLflow run %s, which %s does not have; starting a new MLflow run",
                    id_file, recorded, self.tracking_uri,
                )

        if existing is not None:
            self.run_id = existing.info.run_id
            if existing.info.status != "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            old_params = dict(existing.data.params)
            if resume_step is not None and existing.data.metrics:
                # Points are deleted only in the run this run directory recorded: an --mlflow-run-id of
                # another miles run's keeps its points (this run's steps it already holds are skipped).
                ours = id_file.exists() and id_file.read_text(encoding="utf-8").strip() == self.run_id
                self._forget_from(resume_step, list(existing.data.metrics), delete=ours)
        else:
            own = is_run_store(cfg.mlflow_tracking_uri, Path(run_dir))
            experiment_id = self._experiment_id(cfg.mlflow_experiment_name, run_dir if own else None)
            run = self.client.create_run(
                experiment_id, run_name=cfg.mlflow_run_name or run_id, tags={"miles.run_id": run_id}
            )
            self.run_id = run.info.run_id
            old_params = {}
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        _write_atomic(id_file, self.run_id + "\n")
        self._log_params(params, old_params)

    def _forget_from(self, step: int, keys: list[str], *, delete: bool) -> None:
        """Before steps >= `step` are logged again: delete their points (`delete` and a SQL store), else
        remember the (key, step) pairs the run holds so `log_many` skips them (see the module docstring)."""
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        # Why delete rather than only skip the held (key, step) pairs: the redone steps are not always
        # the values MLflow holds. Timings (perf/*) differ in every run, every value differs without
        # --train-deterministic (the GPU recipes' default), and steps the killed attempt logged past
        # the point where the resume stops would stay; MLflow's public API cannot delete a point.
        store = self.client._tracking_client.store
        if delete and isinstance(store, SqlAlchemyStore):
            from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

            with store.ManagedSessionMaker(read_only=False) as session:  # one transaction: all of it or nothing
                mine = SqlMetric.run_uuid == self.run_id
                session.query(SqlMetric).filter(mine, SqlMetric.step >= step).delete(synchronize_session=False)
                # latest_metrics may name a deleted point: rebuild it from what is left (MLflow's order:
                # the greatest (step, timestamp, value) is the latest).
                session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == self.run_id).delete(synchronize_session=False)
                latest: dict[str, Any] = {}
                for m in session.query(SqlMetric).filter(mine):
                    old = latest.get(m.key)
                    if old is None or (m.step, m.timestamp, m.value) > (old.step, old.timestamp, old.value):
                        latest[m.key] = m
                session.add_all(
                    SqlLatestMetric(key=m.key, value=m.value, timestamp=m.timestamp, step=m.step, is_nan=m.is_nan, run_uuid=self.run_id)
                    for m in latest.values()
                )
            return
        for key in keys:
            self._held.update((key, m.step) for m in self.client.get_metric_history(self.run_id, key) if m.step >= step)
        if self._held:
            log.warning(
                "MLflow run %s already has steps >= %d, which this run logs again; they are not sent again (%s), "
                "so MLflow keeps the values it has there (metrics.jsonl has the new ones)",
                self.run_id, step, "its store cannot delete points" if delete else "it is not this run directory's MLflow run",
            )

    def _experiment_id(self, name: str, run_dir: Path | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            # The default store's artifacts (curves.png) live in the run directory, not in the
            # working directory's ./mlruns that MLflow would pick.
            where = None if run_dir is None else (Path(run_dir).resolve() / ARTIFACTS_DIR).as_uri()
            return self.client.create_experiment(name, artifact_location=where)
        if exp.lifecycle_stage == "deleted":
            raise UserError(
                f"MLflow experiment {name!r} is deleted in {self.tracking_uri}; restore it "
                "(mlflow experiments restore) or pick another --mlflow-experiment-name.",
                option="--mlflow-experiment-name",
            )
        return exp.experiment_id

    def _log_params(self, params: Mapping[str, Any] | Any, old: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        flat: dict[str, str] = {}
        for key, value in flatten_params(params).items():
            flat.setdefault(mlflow_key(key), value)
        new = [Param(k, v) for k, v in flat.items() if k not in old]
        changed = [RunTag(mlflow_key(f"changed_param/{k}"), v) for k, v in flat.items() if k in old and old[k] != v]
        if changed:
            log.warning(
                "MLflow run %s already has params %s with other values; recorded the new values as "
                "changed_param/* tags", self.run_id, ", ".join(t.key.split("/", 1)[1] for t in changed),
            )
        for i in range(0, len(new), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + _PARAMS_PER_BATCH])
        for i in range(0, len(changed), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=changed[i : i + _PARAMS_PER_BATCH])

    def _key(self, key: str) -> str | None:
        name = mlflow_key(key)
        owner = self._key_owner.setdefault(name, key)
        if owner == key:
            return name
        if key not in self._reported:
            self._reported.add(key)
            log.warning("metric %r maps to MLflow key %r, already used by %r; not sent to MLflow", key, name, owner)
        return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_many([(metrics, step)])

    def log_many(self, records: list[tuple[Mapping[str, float], int]]) -> None:
        """Several (metrics, step) records in as few `log_batch` calls as MLflow allows (one store
        transaction each): the background writer sends what queued up since its last write."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = []
        for metrics, step in records:
            for key, value in metrics.items():
                name = self._key(key)
                if name is not None and (name, step) not in self._held:
                    batch.append(Metric(name, value, ts, step))
        for i in range(0, len(batch), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _METRICS_PER_BATCH])

    def log_artifact(self, path: Path) -> None:
        """Attach the file at `path` (the run's plot) to the MLflow run."""
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
